"""The scheduler's periodic log lines, in SGLang's words: one "Prefill batch." line per prefill batch
and one "Decode batch." line every --decode-log-interval decode iterations, with the KV use of each
tier (the exact pool; the compressed tier's chunks in the two-tier modes) and, in VeriCache mode,
the rounds run since the last line and their accept length (tokens per round)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class KVUse:
    """The exact pool's tokens in use (the prefix cache's evictable ones excluded, as SGLang counts)
    and, in the two-tier modes, the compressed tier's chunks held (None: no compressed tier)."""

    exact_used: int
    exact_total: int
    comp_used: int | None = None
    comp_total: int | None = None

    def text(self) -> str:
        out = f"#token: {self.exact_used}, token usage: {self.exact_used / max(self.exact_total, 1):.2f}"
        if self.comp_total is not None:
            out += (f", #compressed-chunk: {self.comp_used}/{self.comp_total}, "
                    f"compressed usage: {self.comp_used / max(self.comp_total, 1):.2f}")
        return out


def kv_use(s: Scheduler) -> KVUse:
    used = s.max_total_num_tokens - s.allocator.available_size() - s.tree_cache.evictable_size()
    use = KVUse(used, s.max_total_num_tokens)
    if s.two_tier is not None:
        pool = s.two_tier.pool
        use.comp_used, use.comp_total = pool.num_chunks - pool.available_chunks(), pool.num_chunks
    return use


def prefill_line(new_seq: int, new_token: int, cached_token: int, use: KVUse, running: int, queue: int) -> str:
    return (f"Prefill batch. #new-seq: {new_seq}, #new-token: {new_token}, #cached-token: {cached_token}, "
            f"{use.text()}, #running-req: {running}, #queue-req: {queue}")


def decode_line(running: int, use: KVUse, gen_throughput: float, queue: int,
                spec: tuple[int, int] | None = None) -> str:
    """spec: (rounds, accepted drafts) since the last line, in VeriCache mode (None otherwise)."""
    out = f"Decode batch. #running-req: {running}, {use.text()}, "
    if spec is not None:
        rounds, accepted = spec
        out += f"#spec-round: {rounds}, "
        if rounds:
            out += f"accept len: {(accepted + rounds) / rounds:.2f}, "
    return out + f"gen throughput (token/s): {gen_throughput:.2f}, #queue-req: {queue}"


class BatchLog:
    def __init__(self, decode_log_interval: int, vericache: bool, enabled: bool = True) -> None:
        self.interval = decode_log_interval
        self.vericache = vericache
        self.enabled = enabled  # tensor parallelism: rank 0 logs, the other ranks' lines would repeat it
        self.decode_iters = 0
        self.last_time = time.perf_counter()
        self.last_tokens = 0
        self.last_cached = 0
        self.last_spec = (0, 0)

    def on_prefill(self, s: Scheduler, batch: list[tuple[Req, int]]) -> None:
        """Before a prefill batch runs: (req, new tokens) each; cached = prefix hits since the last one."""
        m = s.metrics
        cached, self.last_cached = m.num_cached_tokens_total - self.last_cached, m.num_cached_tokens_total
        if not s.running:  # idle until now: the next throughput is measured from here
            self.last_time, self.last_tokens = time.perf_counter(), m.num_generation_tokens_total
        if self.enabled and logger.isEnabledFor(logging.INFO):
            logger.info(prefill_line(len(batch), sum(n for _, n in batch), cached, kv_use(s), len(s.running),
                                     len(s.waiting_queue)))

    def on_decode(self, s: Scheduler) -> None:
        """Before a decode iteration (one step; in VeriCache mode one round iteration): its running
        requests, the KV before it, and the throughput since the last line (SGLang's counts)."""
        self.decode_iters += 1
        if self.decode_iters % self.interval:
            return
        m, now = s.metrics, time.perf_counter()
        tput = (m.num_generation_tokens_total - self.last_tokens) / max(now - self.last_time, 1e-9)
        spec = (m.spec_rounds_total, m.spec_accepted_total)
        delta = (spec[0] - self.last_spec[0], spec[1] - self.last_spec[1])
        self.last_time, self.last_tokens, self.last_spec = now, m.num_generation_tokens_total, spec
        if self.enabled and logger.isEnabledFor(logging.INFO):
            logger.info(decode_line(len(s.running), kv_use(s), tput, len(s.waiting_queue),
                                    delta if self.vericache else None))
