"""--watchdog-timeout (default: 300 s on CUDA, off on a CPU): a scheduler iteration that runs past
the timeout is a hung forward (a stuck kernel, a deadlocked transfer). The process then dumps
every thread's stack and exits, so the TokenizerManager fails the requests with an error and
/health turns 503, instead of clients waiting forever (SGLang's watchdog)."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

EXIT_CODE = 3  # the scheduler's exit code when its watchdog ends it
TP_EXIT_CODE = 4  # a tensor-parallel rank's exit code when a collective failed (a peer rank gone or silent)


def _exit_process(elapsed_s: float) -> None:
    logger.error("watchdog: one scheduler iteration has run for %.0f s (--watchdog-timeout); dumping the "
                 "threads' stacks and exiting", elapsed_s)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os._exit(EXIT_CODE)


def describe_exit(code: int | None, rank: int | None = None) -> str:
    """The TokenizerManager's words for a scheduler process (of tensor-parallel `rank`) that exited with `code`."""
    what = f"the scheduler process exited with code {code}"
    if rank is not None:
        what = f"the scheduler process of tensor-parallel rank {rank} exited with code {code}"
        if code == TP_EXIT_CODE:
            what += " (a collective failed: a peer rank exited or stopped answering; see its log)"
        elif code is not None and code < 0:
            what += f" (killed by signal {-code}); the other ranks exit with it"
    if code == EXIT_CODE:
        what += " (its watchdog: one iteration ran past --watchdog-timeout; the stacks are in its log)"
    return what


class StepWatchdog:
    def __init__(self, timeout_s: float, on_timeout: Callable[[float], None] = _exit_process) -> None:
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self.started: float | None = None  # when the running iteration began; None between iterations
        self.fired = False
        self._thread = threading.Thread(target=self._watch, name="scheduler-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def step(self) -> Iterator[None]:
        self.started = time.monotonic()
        try:
            yield
        finally:
            self.started = None

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while True:
            time.sleep(period)
            started = self.started
            if started is not None and (elapsed := time.monotonic() - started) > self.timeout_s:
                self.fired = True
                self.on_timeout(elapsed)
                return
