"""CopyStream: where the host tier's copies run and how compute waits for them (ARCHITECTURE.md 11).

The transfer engine (mem_cache/transfer_engine.py) is one FIFO queue of copies, like one DMA
engine; this is the device side of it, one interface with two implementations:

    mark()           a point on the compute stream: a copy submitted now runs after everything the
                     compute thread queued before it (a staging slot is not overwritten while a
                     kernel still reads it)
    run(fn, after)   run fn (its copies) on the copy stream after `after` -> the copy's event
    compute_wait(e)  the compute stream waits for event e: the host thread goes on queueing work,
                     the device does not synchronize
    finish(e)        the copy thread waits for e (before reusing a bounce buffer, and so the link's
                     busy time is the copy's real time)

CudaCopyStream: a side stream and CUDA events (host tier in pinned memory, non_blocking copies).
EmulatedCopyStream (a CPU): the host and the "device" are the same DRAM; a copy is done when fn
returns, so every event is None and nothing waits; the transfer engine's throttle is the link.
Both run the same engine, stager and forward code.

Invariant: a consumer reads a copy's destination only after compute_wait(its event); a producer
overwrites a source or destination buffer only after finish() of the last copy that used it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class CopyStream:
    """The CPU emulation: copies are synchronous in the transfer thread; no events."""

    pin_memory = False  # whether host-side staging buffers are page-locked

    def mark(self) -> object:
        return None

    def run(self, fn: Callable[[], None], after: object) -> object:
        fn()
        return None

    def compute_wait(self, event: object) -> None:
        pass

    def finish(self, event: object) -> None:
        pass

    def query(self, event: object) -> bool:
        return True


EmulatedCopyStream = CopyStream


class CudaCopyStream(CopyStream):
    """A side stream of `device`; events order it against the compute (current) stream."""

    pin_memory = True

    def __init__(self, device: torch.device, cuda=None):
        self.cuda = cuda if cuda is not None else torch.cuda  # tests pass a fake with the same calls
        self.device = device
        self.stream = self.cuda.Stream(device)

    def mark(self) -> object:
        ev = self.cuda.Event()
        ev.record(self.cuda.current_stream(self.device))
        return ev

    def run(self, fn: Callable[[], None], after: object) -> object:
        with self.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            fn()
            done = self.cuda.Event()
            done.record(self.stream)
        return done

    def compute_wait(self, event: object) -> None:
        if event is not None:
            self.cuda.current_stream(self.device).wait_event(event)

    def finish(self, event: object) -> None:
        if event is not None:
            event.synchronize()

    def query(self, event: object) -> bool:
        return event is None or event.query()


def copy_stream_for(device: torch.device) -> CopyStream:
    return CudaCopyStream(device) if device.type == "cuda" else EmulatedCopyStream()
