"""SchedulerMetrics: counters behind /metrics and /server_info."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sglang_vericache.managers.io_struct import SchedulerStats

if TYPE_CHECKING:
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.managers.scheduler import Scheduler

THROUGHPUT_WINDOW_S = 10.0


@dataclass
class SchedulerMetrics:
    num_prompt_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    num_cached_tokens_total: int = 0
    num_requests_total: int = 0
    num_finished_total: int = 0
    num_retracted_total: int = 0
    spec_rounds_total: int = 0
    spec_drafted_total: int = 0
    spec_accepted_total: int = 0
    spec_draft_forwards_total: int = 0  # forwards with draft rows (DRAFT_DECODE or MIXED)
    spec_draft_rows_total: int = 0  # draft rows in them (one per drafting request, plus n-gram proposals)
    spec_ngram_proposed_total: int = 0  # n-gram proposal tokens checked by the drafter
    spec_ngram_accepted_total: int = 0  # of them, the drafter's own samples (taken as drafts)
    samples: deque = field(default_factory=lambda: deque(maxlen=256))
    # Benchmarks set a list here to record (drafted, accepted) of every VeriCache round.
    round_trace: list | None = None

    def on_spec_round(self, drafted: int, accepted: int) -> None:
        if self.round_trace is not None:
            self.round_trace.append((drafted, accepted))
        self.spec_rounds_total += 1
        self.spec_drafted_total += drafted
        self.spec_accepted_total += accepted

    def on_finish(self, req: Req) -> None:
        self.num_finished_total += 1

    def throughput(self) -> float:
        now = time.monotonic()
        self.samples.append((now, self.num_generation_tokens_total))
        while self.samples and now - self.samples[0][0] > THROUGHPUT_WINDOW_S:
            self.samples.popleft()
        t0, n0 = self.samples[0]
        return (self.num_generation_tokens_total - n0) / (now - t0) if now > t0 else 0.0

    def snapshot(self, s: Scheduler) -> SchedulerStats:
        used = s.max_total_num_tokens - s.allocator.available_size() - s.tree_cache.evictable_size()
        hits = getattr(s.tree_cache, "hit_rate", None)
        return SchedulerStats(
            **s.queues.stats(),  # num_running_reqs, num_waiting_reqs: reported by their owner
            num_used_tokens=used,
            max_total_num_tokens=s.max_total_num_tokens,
            token_usage=used / s.max_total_num_tokens,
            cache_hit_rate=float(hits() if callable(hits) else (hits or 0.0)),
            gen_throughput=self.throughput(),
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            num_cached_tokens_total=self.num_cached_tokens_total,
            num_requests_total=self.num_requests_total,
            num_retracted_total=self.num_retracted_total,
            extra={
                "kv_mode": s.mode,
                **self.two_tier_extra(s),
                **(s.prefix_store.metrics() if getattr(s, "prefix_store", None) is not None else {}),
                **self.remote_prefill_extra(s),
                "num_finished_total": self.num_finished_total,
                "evictable_tokens": s.tree_cache.evictable_size(),
                "free_tokens": s.allocator.available_size(),
            },
        )

    def remote_prefill_extra(self, s: Scheduler) -> dict:
        """--disagg-prefill verifier: prefills asked of the verifier, compressed pages cached and
        fetched, the verifier's exact KV received (prefill and rounds)."""
        rp = getattr(s, "remote_prefill", None)
        if rp is None:
            return {}
        st = rp.stats
        return {
            "remote_prefills_total": st["prefills_applied"],
            "remote_prefill_pending": len(rp.prefilling),
            "remote_prefix_pages_total": st["prefix_pages"],
            "remote_store_pages_loaded_total": st["store_pages_loaded"],
            "remote_cached_pages": len(s.tree_cache.pages),
            "remote_kv_bytes_received_total": st["kv_bytes_received"] + s.spec_worker.stats["round_kv_bytes"],
        }

    def two_tier_extra(self, s: Scheduler) -> dict:
        if s.two_tier is None:
            return {}
        pool = s.two_tier.pool
        rounds = max(self.spec_rounds_total, 1)
        return {
            "compressed_chunks_total": pool.num_chunks,
            "compressed_chunks_free": pool.available_chunks(),
            "compressed_chunks_cached": s.tree_cache.comp_total_chunks(),
            "compressed_bytes_per_chunk": pool.bytes_per_chunk(),
            "compressed_prefix_hit_rate": s.tree_cache.comp_hit_rate(),
            "spec_rounds_total": self.spec_rounds_total,
            "spec_drafted_tokens_total": self.spec_drafted_total,
            "spec_accepted_tokens_total": self.spec_accepted_total,
            "spec_accept_length": (self.spec_accepted_total + self.spec_rounds_total) / rounds,
            "spec_draft_forwards_total": self.spec_draft_forwards_total,
            "spec_draft_rows_total": self.spec_draft_rows_total,
            "spec_ngram_proposed_tokens_total": self.spec_ngram_proposed_total,
            "spec_ngram_accepted_tokens_total": self.spec_ngram_accepted_total,
        }
