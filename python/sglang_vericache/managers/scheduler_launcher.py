"""Starting the Scheduler process (spawn) and waiting for its SchedulerReady or its load error."""

from __future__ import annotations

import multiprocessing as mp
import time

from sglang_vericache.managers.io_struct import SchedulerReady
from sglang_vericache.server_args import PortArgs, ServerArgs

SCHEDULER_READY_TIMEOUT_S = 600.0


def _scheduler_main(server_args: ServerArgs, port_args: PortArgs, writer) -> None:
    # Imported in the child only: the parent never pays for torch and the model code here.
    from sglang_vericache.managers.scheduler import run_scheduler_process

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
