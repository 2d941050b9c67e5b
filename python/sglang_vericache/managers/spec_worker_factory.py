"""create_spec_worker: the VeriCache round driver the configuration asks for, chosen once.

The scheduler holds the one BaseSpecWorker (speculative/base_spec_worker.py) this returns and
calls it without asking which it is. Which one:
  --disagg-role drafter          RemoteVerifyWorker (disagg/remote_verify.py): verification on a
                                 remote verifier;
  --vericache-schedule staggered StaggeredVeriCache (speculative/stagger.py);
  --vericache-schedule adaptive  AdaptiveVeriCache (speculative/adaptive.py);
  --vericache-schedule lockstep  VeriCacheWorker (speculative/vericache_worker.py).
The verifier of dual-instance VeriCache (--disagg-role verifier) runs a full-mode scheduler whose
worker, VerifyWorker (disagg/verify_worker.py), VerifierServer installs with its sessions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_vericache.managers.scheduler import Scheduler
    from sglang_vericache.server_args import ServerArgs
    from sglang_vericache.speculative.base_spec_worker import BaseSpecWorker


def create_spec_worker(args: ServerArgs, sched: Scheduler) -> BaseSpecWorker:
    """The worker of sched's VeriCache rounds (sched.round), over its memory and running list."""
    if args.disagg_role == "drafter":
        from sglang_vericache.disagg.remote_verify import RemoteVerifyWorker

        return RemoteVerifyWorker(args, sched.round, sched.memory, sched.running,
                                  sched.model_runner.token_to_kv_pool, sched.abort, sched.recv_socket,
                                  sched.prefix_store)
    if args.staggered:
        from sglang_vericache.speculative.stagger import StaggeredVeriCache

        return StaggeredVeriCache(sched.round, sched.memory, sched.running, sched.link)
    if args.adaptive:
        from sglang_vericache.speculative.adaptive import AdaptiveVeriCache

        return AdaptiveVeriCache(args, sched.round, sched.memory, sched.running, sched.link, sched.two_tier,
                                 sched.model_runner, sched.page_size)
    from sglang_vericache.speculative.vericache_worker import VeriCacheWorker

    return VeriCacheWorker(sched.round, sched.memory, sched.running, sched.link)
