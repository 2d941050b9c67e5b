"""TransferEngine: asynchronous host -> device copies of exact KV over a (possibly throttled) link.

One worker thread runs jobs strictly FIFO, like one DMA queue. A job is (copy_fn, nbytes, tag):
the worker runs copy_fn (the real copy), then, if a bandwidth is set, sleeps until
nbytes / bandwidth seconds have passed since the job started (the copy's own time counts). So on a
CPU-only machine the link is real: its bytes are really moved, its time is really spent off the
compute thread, and link/compute overlap is measurable.

On CUDA the worker issues copy_fn on a side stream (copy_fn should use non_blocking=True copies
from pinned host memory), after the work the submitting thread had queued on its current stream
(so a staging buffer is not overwritten while compute still reads it), and waits for the copy's
event before the job counts as done; the throttle applies on top.

Invariants: jobs start in submission order and never overlap (busy_intervals are disjoint and
sorted); a handle is done only after its copy finished and its link time passed; an exception in
copy_fn is re-raised by handle.wait() (later jobs still run).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch


MAX_INTERVALS = 1 << 17


@dataclass
class TransferHandle:
    tag: str
    nbytes: int
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _error: BaseException | None = field(default=None, repr=False)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the copy finished and its link time passed; re-raise copy_fn's exception."""
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"transfer {self.tag!r} failed") from self._error


@dataclass
class _Job:
    copy_fn: Callable[[], None]
    handle: TransferHandle
    after: object = None  # CUDA: an event on the submitter's stream the copy must wait for


class TransferEngine:
    def __init__(
        self,
        bandwidth: float | None,
        device: str | torch.device = "cpu",
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if bandwidth is not None and not bandwidth > 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s (or None), got {bandwidth}")
        self.bandwidth = bandwidth
        self.device = torch.device(device)
        self.clock, self.sleep = clock, sleep
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.reset_stats()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self._closed = False
        self._worker.start()

    # ---- API ------------------------------------------------------------------------------
    def submit(self, copy_fn: Callable[[], None], nbytes: int, tag: str = "") -> TransferHandle:
        """Queue one copy of nbytes (what the link is charged); -> a handle to wait on."""
        if self._closed:
            raise RuntimeError("TransferEngine is shut down")
        handle = TransferHandle(tag, int(nbytes))
        after = None
        if self.cuda:  # order the copy after what this thread already queued on its stream
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        self._queue.put(_Job(copy_fn, handle, after))
        return handle

    def reset_stats(self) -> None:
        # (start, end, nbytes, tag) of the recent jobs; bounded so a long-running server does not grow.
        self.busy_intervals: deque[tuple[float, float, int, str]] = deque(maxlen=MAX_INTERVALS)
        self.bytes_total = 0
        self.busy_seconds = 0.0

    def shutdown(self) -> None:
        """Finish the queued jobs, then stop the worker. Idempotent."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._worker.join()

    # ---- worker ---------------------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            h = job.handle
            start = self.clock()
            try:
                self._copy(job)
            except BaseException as e:  # surfaced by handle.wait()
                h._error = e
            if self.bandwidth is not None:
                left = start + h.nbytes / self.bandwidth - self.clock()
                if left > 0:
                    self.sleep(left)
            end = self.clock()
            self.busy_intervals.append((start, end, h.nbytes, h.tag))
            self.bytes_total += h.nbytes
            self.busy_seconds += end - start
            h._done.set()

    def _copy(self, job: _Job) -> None:
        if not self.cuda:
            job.copy_fn()
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(job.after)
            job.copy_fn()
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()  # the job's time includes the real copy
