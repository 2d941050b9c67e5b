"""torch.profiler in the scheduler process, driven by /start_profile and /stop_profile (SGLang's).

A start begins a profile of everything the scheduler runs (forwards, sampling, cache work) and
names the Chrome trace it will write: OUTPUT_DIR/PROFILE_ID-TP-0.trace.json, OUTPUT_DIR being
the request's output_dir, else $SGLANG_TORCH_PROFILER_DIR, else /tmp. The trace is written on
/stop_profile, or by itself after num_steps scheduler steps with work. A second start while one
runs, or a stop while none runs, is refused (the HTTP server answers 400).
"""

from __future__ import annotations

import logging
import os
import time

from sglang_vericache.managers.io_struct import ProfileReq, ProfileReqOutput

logger = logging.getLogger(__name__)


def default_profile_dir() -> str:
    return os.environ.get("SGLANG_TORCH_PROFILER_DIR") or "/tmp"


class SchedulerProfiler:
    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.profiler = None  # the running torch.profiler.profile
        self.trace_path: str | None = None  # where the running (or the last) profile's trace goes
        self.steps_left: int | None = None

    @property
    def running(self) -> bool:
        return self.profiler is not None

    def handle(self, req: ProfileReq) -> ProfileReqOutput:
        if req.kind == "start":
            return self.start(req)
        if req.kind == "stop":
            return self.stop()
        return ProfileReqOutput(False, f"unknown profile request kind {req.kind!r}")

    def start(self, req: ProfileReq) -> ProfileReqOutput:
        import torch.profiler as tp

        if self.running:
            return ProfileReqOutput(False, f"profiling is already running (its trace goes to {self.trace_path}); "
                                           "call /stop_profile first")
        names = req.activities or (["CPU", "GPU"] if self.cuda else ["CPU"])
        if "GPU" in names and not self.cuda:
            return ProfileReqOutput(False, "activities: GPU needs a server on CUDA (this one runs on the CPU)")
        activities = [tp.ProfilerActivity.CPU if n == "CPU" else tp.ProfilerActivity.CUDA for n in names]
        out_dir = req.output_dir or default_profile_dir()
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            return ProfileReqOutput(False, f"output_dir {out_dir}: {e.strerror or e}")
        if not os.access(out_dir, os.W_OK):
            return ProfileReqOutput(False, f"output_dir {out_dir} is not writable")
        path = os.path.join(out_dir, f"{req.profile_id or time.time()}-TP-0.trace.json")
        profiler = tp.profile(activities=activities, with_stack=bool(req.with_stack),
                              record_shapes=bool(req.record_shapes))
        profiler.start()
        self.profiler, self.trace_path, self.steps_left = profiler, path, req.num_steps
        logger.info("profiling started (%s); the trace goes to %s%s", ", ".join(names), path,
                    f" after {req.num_steps} steps" if req.num_steps else "")
        return ProfileReqOutput(True, f"Start profiling. The trace goes to {path}.")

    def stop(self) -> ProfileReqOutput:
        if not self.running:
            last = f" (the last trace went to {self.trace_path})" if self.trace_path else ""
            return ProfileReqOutput(False, f"profiling is not running{last}; call /start_profile first")
        profiler, self.profiler, self.steps_left = self.profiler, None, None
        try:
            profiler.stop()
            profiler.export_chrome_trace(self.trace_path)
        except Exception as e:  # noqa: BLE001 - a failed export must not take the scheduler down
            logger.exception("profiling: writing the trace failed")
            return ProfileReqOutput(False, f"writing the trace {self.trace_path} failed: {type(e).__name__}: {e}")
        logger.info("profiling stopped; trace written to %s", self.trace_path)
        return ProfileReqOutput(True, f"Stop profiling. The trace is at {self.trace_path}.")

    def on_step(self) -> None:
        """After a scheduler step that ran work: counts down num_steps, then writes the trace."""
        if self.steps_left is None:
            return
        self.steps_left -= 1
        if self.steps_left <= 0:
            self.stop()
