"""Starting the Scheduler process (spawn) and waiting for its SchedulerReady or its load error."""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import os
import signal
import sys
import time

from sglang_vericache.managers.io_struct import SchedulerReady
from sglang_vericache.server_args import PortArgs, ServerArgs

SCHEDULER_READY_TIMEOUT_S = 600.0
logger = logging.getLogger("sglang_vericache.managers.scheduler")  # the scheduler's log lines


def _scheduler_main(server_args: ServerArgs, port_args: PortArgs, writer) -> None:
    run_scheduler_process(server_args, port_args, writer)


def start_scheduler(server_args: ServerArgs, port_args: PortArgs):
    """Spawns the Scheduler process; returns it and the pipe its SchedulerReady will come on."""
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_scheduler_main, args=(server_args, port_args, writer), daemon=True)
    proc.start()
    writer.close()
    return proc, reader


def wait_scheduler_ready(proc: mp.Process, reader) -> SchedulerReady:
    """The scheduler's SchedulerReady, or a RuntimeError with its load error."""
    deadline = time.monotonic() + SCHEDULER_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if reader.poll(0.2):
            try:
                msg = reader.recv()
            except EOFError:
                msg = None
            if isinstance(msg, SchedulerReady):
                return msg
            proc.join(5)
            if proc.is_alive():
                proc.kill()
            if isinstance(msg, dict) and "error" in msg:
                raise RuntimeError(f"the scheduler failed to start: {msg['error']}")
            raise RuntimeError(f"the scheduler process exited (code {proc.exitcode}) before it was ready")
        if not proc.is_alive():
            raise RuntimeError(f"the scheduler process exited (code {proc.exitcode}) before it was ready")
    proc.kill()
    raise RuntimeError(f"the scheduler was not ready after {SCHEDULER_READY_TIMEOUT_S:.0f} s")


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, pipe_writer) -> None:
    logging.basicConfig(
        level=getattr(logging, server_args.log_level.upper(), logging.INFO),
        format="[%(asctime)s scheduler] %(message)s",
    )
    faulthandler.enable()
    # The parent's death must not leave this process behind.
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    try:
        from sglang_vericache.managers.scheduler import Scheduler  # the child only: torch, the model code

        scheduler = Scheduler(server_args, port_args)
    except Exception as e:  # load errors go to the parent, which prints them
        logger.exception("scheduler failed to start")
        pipe_writer.send({"error": f"{type(e).__name__}: {e}"})
        os._exit(1)
    pipe_writer.send(scheduler.ready_message())
    try:
        scheduler.event_loop()
    except Exception:
        logger.exception("scheduler crashed")
        os._exit(1)
