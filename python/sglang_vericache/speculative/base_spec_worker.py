"""BaseSpecWorker: the one interface the scheduler drives VeriCache rounds through.

As in SGLang, each speculative schedule is one worker class behind one interface, chosen once from
the configuration (managers/spec_worker_factory.py:create_spec_worker); the scheduler holds that
one object and calls these methods, never asking which worker it is:

  open_session(req)            at admission; (error, HTTP status) refuses the request
                               (the remote drafter opens the verifier's session here);
  poll()                       first thing in every scheduler step (the remote drafter: results,
                               heartbeat, a verifier gone away);
  observe_prefill(spans, s)    after every prefill (EXTEND) forward (the adaptive cost fit);
  forward_batch_generation()   one decode iteration of the running requests' rounds;
  release(req)                 req leaves the running set: finished, aborted or retracted
                               (a booked verification goes back);
  admission_gate               admission beyond memory, or None (the adaptive controller's say);
  server_info(args)            what /server_info reports of the schedule.
The workers:
  VeriCacheWorker      speculative/vericache_worker.py  RoundLoop, fixed plan: a whole round per step;
  StaggeredVeriCache   speculative/stagger.py           RoundLoop, fixed plan: booked verifications;
  AdaptiveVeriCache    speculative/adaptive.py          RoundLoop, the controller's plan per step;
  RemoteVerifyWorker   disagg/remote_verify.py          the drafter of dual-instance VeriCache;
  VerifyWorker         disagg/verify_worker.py          the verifier of dual-instance VeriCache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.server_args import ServerArgs


class BaseSpecWorker(ABC):
    # Counters this worker owns (reported by it, e.g. through the scheduler's stats).
    stats: dict

    def open_session(self, req: Req) -> tuple[str, int] | None:
        """At admission: None to go on, or (error message, HTTP status) to refuse req."""
        return None

    def poll(self) -> None:
        """Start of every scheduler step, before anything else runs."""

    def observe_prefill(self, spans: list[tuple[int, int]], seconds: float) -> None:
        """A prefill forward took `seconds`; spans are (prefix length, rows) per request."""

    @abstractmethod
    def forward_batch_generation(self) -> None:
        """One decode iteration: each running request advances its round (the worker makes its own
        room in the KV pools)."""

    def release(self, req: Req) -> None:
        """req leaves the running set (finished, aborted or retracted)."""

    @property
    def admission_gate(self) -> Callable[[Req, list[Req]], bool] | None:
        """Whether to admit req after the pending ones of its prefill batch; None: memory alone decides."""
        return None

    def server_info(self, args: ServerArgs) -> dict:
        return {"speculative_algorithm": "VERICACHE",
                "speculative_num_draft_tokens": args.speculative_num_draft_tokens}
