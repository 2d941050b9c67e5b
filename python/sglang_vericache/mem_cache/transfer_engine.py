"""TransferEngine: asynchronous host -> device copies of exact KV over a (possibly throttled) link.

One worker thread runs jobs strictly FIFO, like one DMA queue. A job is (copy_fn, nbytes, tag):
the worker issues copy_fn (the real copy) on the copy stream (mem_cache/copy_stream.py), then, if
a bandwidth is set, sleeps until nbytes / bandwidth seconds have passed since the job started (the
copy's own time counts). So on a CPU-only machine the link is real: its bytes are really moved,
its time is really spent off the compute thread, and link/compute overlap is measurable.

On CUDA (CudaCopyStream) copy_fn runs on a side stream (non_blocking copies from pinned host
memory), ordered after the work the submitting thread had queued on its stream (so a staging slot
is not overwritten while compute still reads it). The handle is ready once the copy is issued and
its link time passed; handle.wait() then makes the *compute stream* wait for the copy's event (the
host thread does not block on the copy, the device does not synchronize). The worker itself waits
for the copy's event before its next job (bounce buffers are reused; busy time is real). On a CPU
(EmulatedCopyStream) the copy is synchronous, so ready and done coincide: the same code.

Invariants: jobs start in submission order and never overlap (busy_intervals are disjoint and
sorted); a handle is done only after its copy finished and its link time passed (ready no later);
an exception in copy_fn is re-raised by handle.wait() (later jobs still run).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from sglang_vericache.mem_cache.copy_stream import CopyStream, copy_stream_for

MAX_INTERVALS = 1 << 17


@dataclass
class TransferHandle:
    tag: str
    nbytes: int
    stream: CopyStream = field(default_factory=CopyStream, repr=False)
    event: object = field(default=None, repr=False)  # the copy's event on the copy stream (CUDA)
    _ready: threading.Event = field(default_factory=threading.Event, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _error: BaseException | None = field(default=None, repr=False)

    def done(self) -> bool:
        """The copy finished and its link time passed."""
        return self._done.is_set()

    def ready(self) -> bool:
        """Compute may be queued behind the copy now (issued, link time passed)."""
        return self._ready.is_set()

    def wait(self) -> None:
        """Wait until the copy is issued and its link time passed, then order the compute stream
        after it (CUDA: a stream wait on its event; a CPU: the copy is already done); re-raise
        copy_fn's exception."""
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"transfer {self.tag!r} failed") from self._error
        self.stream.compute_wait(self.event)


@dataclass
class _Job:
    copy_fn: Callable[[], None]
    handle: TransferHandle
    after: object = None  # the point on the submitter's stream the copy must wait for (CUDA: an event)


class TransferEngine:
    def __init__(
        self,
        bandwidth: float | None,
        device: str | torch.device = "cpu",
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        stream: CopyStream | None = None,
    ):
        if bandwidth is not None and not bandwidth > 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s (or None), got {bandwidth}")
        self.bandwidth = bandwidth
        self.device = torch.device(device)
        self.clock, self.sleep = clock, sleep
        self.cuda = self.device.type == "cuda"
        self.stream = stream if stream is not None else copy_stream_for(self.device)
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
        handle = TransferHandle(tag, int(nbytes), self.stream)
        # The copy runs after what this thread already queued on its (compute) stream.
        self._queue.put(_Job(copy_fn, handle, self.stream.mark()))
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
                h.event = self.stream.run(job.copy_fn, job.after)
            except BaseException as e:  # surfaced by handle.wait()
                h._error = e
            if self.bandwidth is not None:
                left = start + h.nbytes / self.bandwidth - self.clock()
                if left > 0:
                    self.sleep(left)
            if h.event is not None:  # asynchronous copy: compute may queue behind its event now
                h._ready.set()
            try:
                self.stream.finish(h.event)  # before the next job reuses a bounce buffer
            except BaseException as e:
                h._error = h._error or e
            end = self.clock()
            self.busy_intervals.append((start, end, h.nbytes, h.tag))
            self.bytes_total += h.nbytes
            self.busy_seconds += end - start
            h._ready.set()
            h._done.set()
