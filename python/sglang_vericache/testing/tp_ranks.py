"""A pool of tensor-parallel rank processes for tests and by-hand checks: one gloo group, joined once,
that runs jobs (a Scheduler per job, built on every rank, driven in-process by scheduler_harness).

Each job hands every rank the same requests directly (no ZMQ, no broadcast of messages), so what it
checks is the model's and the KV tiers' sharding and the ranks' agreement; the launcher and the
broadcast of requests are checked end to end through Engine(tp_size=...).
Jobs and results travel over multiprocessing pipes between this process and its own children.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import socket
import time
import traceback
from dataclasses import dataclass, field


@dataclass
class Job:
    server_args: dict  # ServerArgs fields (model_path, kv_compressor, ...)
    prompts: list[list[int]]
    max_new_tokens: int = 8
    sampling: dict = field(default_factory=lambda: {"temperature": 0.0})
    return_logprob: bool = True


def run_job(job: Job) -> dict:
    """-> {"output_ids": [...], "logprobs": [...] (float per output token), "meta": [...]} for each prompt."""
    from sglang_vericache.managers.scheduler import Scheduler
    from sglang_vericache.server_args import ServerArgs
    from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

    from sglang_vericache.distributed.parallel_state import get_tp_group

    scheduler = Scheduler(ServerArgs(**{**job.server_args, "tp_size": get_tp_group().size}))
    reqs = [make_request(f"r{i}", ids, seed=i, return_logprob=job.return_logprob,
                         max_new_tokens=job.max_new_tokens, ignore_eos=True, **job.sampling)
            for i, ids in enumerate(job.prompts)]
    res = run_to_completion(scheduler, reqs)
    return {
        "output_ids": [res[r.rid].output_ids for r in reqs],
        "logprobs": [[lp[0] for lp in res[r.rid].output_token_logprobs] for r in reqs],
        "meta": [{k: v for k, v in res[r.rid].meta.items() if k.startswith("spec_")} for r in reqs],
        "tp_stats": dict(get_tp_group().stats),  # collectives this rank has run so far
    }


def _rank_main(rank: int, size: int, addr: str, conn) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid>: this rank's stacks on stderr
    import torch

    torch.set_num_threads(1)
    from sglang_vericache.distributed.parallel_state import init_tensor_parallel

    init_tensor_parallel(size, rank, addr, "cpu", 120.0)
    while True:
        job = conn.recv()
        if job is None:
            conn.close()
            os._exit(0)  # skip the process group's teardown (each rank would wait for the others)
        try:
            out = run_job(job)
            conn.send(("ok", out if rank == 0 else None))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class JobFailed(RuntimeError):
    """A rank raised while running the job (every rank replied; the pool stays usable)."""


class TPRanks:
    """size rank processes (gloo, on this host); run(job) -> rank 0's result of run_job."""

    def __init__(self, size: int = 2) -> None:
        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            addr = f"127.0.0.1:{s.getsockname()[1]}"
        self.conns, self.procs = [], []
        self.broken: str | None = None  # why the pool cannot run jobs any more
        for rank in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(rank, size, addr, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, job: Job, timeout_s: float = 300.0) -> dict:
        if self.broken is not None:
            raise RuntimeError(f"the rank pool is unusable: {self.broken}")
        try:
            return self._run(job, timeout_s)
        except (RuntimeError, TimeoutError) as e:
            if not isinstance(e, JobFailed):  # a rank late or gone: its next reply would answer the wrong job
                self.broken = str(e)
                self.close()
            raise

    def _run(self, job: Job, timeout_s: float) -> dict:
        for c in self.conns:
            c.send(job)
        replies = []
        deadline = time.monotonic() + timeout_s
        for rank, c in enumerate(self.conns):
            while not c.poll(0.5):
                if not self.procs[rank].is_alive():
                    raise RuntimeError(f"rank {rank} exited (code {self.procs[rank].exitcode}) during the job")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank} did not finish the job in {timeout_s} s")
            replies.append(c.recv())
        for rank, (status, payload) in enumerate(replies):
            if status != "ok":
                raise JobFailed(f"rank {rank} failed:\n{payload}")
        return replies[0][1]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
