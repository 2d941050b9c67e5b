"""Starting the Scheduler process (spawn) and waiting for its SchedulerReady or its load error.

With --tp-size N, one scheduler process per tensor-parallel rank on this node (N / --nnodes of
them, ranks node_rank * N / nnodes onward); RankProcesses stands for them as one process: alive
while every rank is, and its exit code is the first failed rank's. Rank 0 sends SchedulerReady;
the others send TPRankReady once their shard is loaded.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import os
import signal
import sys
import time

from sglang_vericache.managers.io_struct import SchedulerReady
from sglang_vericache.managers.watchdog import TP_EXIT_CODE
from sglang_vericache.server_args import PortArgs, ServerArgs

SCHEDULER_READY_TIMEOUT_S = 600.0
logger = logging.getLogger("sglang_vericache.managers.scheduler")  # the scheduler's log lines


class TPRankReady:
    """A rank other than 0 has loaded its shard."""


class RankProcesses:
    """This node's scheduler processes (one per tensor-parallel rank) seen as one process."""

    def __init__(self, procs: list[mp.Process], first_rank: int) -> None:
        self.procs, self.first_rank = procs, first_rank

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def failed(self) -> tuple[int, mp.Process] | None:
        """(rank, process) of a rank that exited, if any: one that failed by itself before one that
        exited because a collective with it failed (TP_EXIT_CODE)."""
        dead = [(self.first_rank + i, p) for i, p in enumerate(self.procs) if not p.is_alive()]
        dead.sort(key=lambda rp: rp[1].exitcode == TP_EXIT_CODE)
        return dead[0] if dead else None

    @property
    def exitcode(self) -> int | None:
        dead = self.failed()
        return None if dead is None else dead[1].exitcode

    @property
    def failed_rank(self) -> int | None:
        dead = self.failed()
        return None if dead is None or len(self.procs) == 1 and self.first_rank == 0 else dead[0]

    def terminate(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.procs:
            p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


def _scheduler_main(server_args: ServerArgs, port_args: PortArgs, writer, tp_rank: int = 0,
                    init_addr: str | None = None) -> None:
    run_scheduler_process(server_args, port_args, writer, tp_rank, init_addr)


def _free_local_addr() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def start_scheduler(server_args: ServerArgs, port_args: PortArgs):
    """Spawns this node's scheduler processes; returns them (RankProcesses) and the pipes their
    ready messages will come on (rank order)."""
    ctx = mp.get_context("spawn")
    per_node = server_args.tp_size // server_args.nnodes
    first = server_args.node_rank * per_node
    init_addr = server_args.dist_init_addr or (_free_local_addr() if server_args.tp_size > 1 else None)
    procs, readers = [], []
    for rank in range(first, first + per_node):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_scheduler_main, args=(server_args, port_args, writer, rank, init_addr),
                           daemon=True)
        proc.start()
        writer.close()
        procs.append(proc)
        readers.append(reader)
    return RankProcesses(procs, first), readers


def wait_scheduler_ready(procs: RankProcesses, readers) -> SchedulerReady | None:
    """Rank 0's SchedulerReady (None on a node without rank 0) once every local rank is ready, or a
    RuntimeError with the first load error."""
    deadline = time.monotonic() + SCHEDULER_READY_TIMEOUT_S
    ready: dict[int, object] = {}
    while len(ready) < len(readers) and time.monotonic() < deadline:
        for i, reader in enumerate(readers):
            if i in ready or not reader.poll(0.2 / len(readers)):
                continue
            try:
                msg = reader.recv()
            except EOFError:
                msg = None
            if isinstance(msg, (SchedulerReady, TPRankReady)):
                ready[i] = msg
                continue
            procs.join(5)
            procs.kill()
            who = "the scheduler" if len(readers) == 1 else f"the scheduler of rank {procs.first_rank + i}"
            if isinstance(msg, dict) and "error" in msg:
                raise RuntimeError(f"{who} failed to start: {msg['error']}")
            raise RuntimeError(f"{who} exited (code {procs.procs[i].exitcode}) before it was ready")
        dead = procs.failed()
        if dead is not None and len(ready) < len(readers):
            procs.kill()
            who = "the scheduler process" if len(readers) == 1 else f"the scheduler process of rank {dead[0]}"
            raise RuntimeError(f"{who} exited (code {dead[1].exitcode}) before it was ready")
    if len(ready) < len(readers):
        procs.kill()
        raise RuntimeError(f"the scheduler was not ready after {SCHEDULER_READY_TIMEOUT_S:.0f} s")
    first = ready.get(0)
    return first if isinstance(first, SchedulerReady) else None


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, pipe_writer, tp_rank: int = 0,
                          init_addr: str | None = None) -> None:
    tag = "scheduler" if server_args.tp_size == 1 else f"scheduler TP{tp_rank}"
    logging.basicConfig(
        level=getattr(logging, server_args.log_level.upper(), logging.INFO),
        format=f"[%(asctime)s {tag}] %(message)s",
    )
    faulthandler.enable()
    # The parent's death must not leave this process behind.
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    from sglang_vericache.distributed.parallel_state import TensorParallelError

    try:
        from sglang_vericache.distributed.parallel_state import init_tensor_parallel
        from sglang_vericache.managers.scheduler import Scheduler  # the child only: torch, the model code

        init_tensor_parallel(server_args.tp_size, tp_rank, init_addr, server_args.device, server_args.dist_timeout,
                             bool(server_args.enable_deterministic_inference))
        scheduler = Scheduler(server_args, port_args)
    except Exception as e:  # load errors go to the parent, which prints them
        logger.exception("scheduler failed to start")
        pipe_writer.send({"error": f"{type(e).__name__}: {e}"})
        os._exit(1)
    pipe_writer.send(scheduler.ready_message() if tp_rank == 0 else TPRankReady())
    try:
        scheduler.event_loop()
    except TensorParallelError as e:
        logger.error("tensor-parallel rank %d exits: %s", tp_rank, e)
        os._exit(TP_EXIT_CODE)
    except Exception:
        logger.exception("scheduler crashed")
        os._exit(1)


def run_other_node(server_args: ServerArgs) -> int:
    """--node-rank > 0: this node's ranks only (node 0 serves HTTP and runs rank 0); returns their
    exit code once one of them exits (the others are ended with it)."""
    procs, readers = start_scheduler(server_args, None)
    wait_scheduler_ready(procs, readers)
    logger.info("node %d: ranks %d-%d ready", server_args.node_rank, procs.first_rank,
                procs.first_rank + len(procs.procs) - 1)
    while procs.is_alive():
        time.sleep(1.0)
    rank, proc = procs.failed()
    logger.error("tensor-parallel rank %d exited with code %s; ending this node's other ranks", rank, proc.exitcode)
    procs.terminate()
    procs.join(5)
    procs.kill()
    return proc.exitcode or 1
