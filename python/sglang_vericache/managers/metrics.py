"""Request metrics and the Prometheus text exposition for /metrics (SGLang's `sglang:` names)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_vericache.managers.io_struct import SchedulerStats
    from sglang_vericache.managers.req_state import ReqState

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, cum = [], 0
        for bound, count in zip(self.buckets, self.counts):
            cum += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {cum}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.n}')
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        out.append(f"{name}_count{{{labels}}} {self.n}")
        return out


@dataclass
class RequestMetrics:
    """Counted in the TokenizerManager when a request finishes."""

    num_requests_total: int = 0
    num_aborted_requests_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cached_tokens_total: int = 0
    e2e_latency: Histogram = field(default_factory=Histogram)
    time_to_first_token: Histogram = field(default_factory=Histogram)

    def observe_finished(self, state: ReqState) -> None:
        self.num_requests_total += 1
        if (state.finished_reason or {}).get("type") == "abort":
            self.num_aborted_requests_total += 1
        self.prompt_tokens_total += state.prompt_tokens
        self.generation_tokens_total += state.completion_tokens
        self.cached_tokens_total += state.cached_tokens
        self.e2e_latency.observe(state.finish_time - state.created)
        if state.first_token_time is not None:
            self.time_to_first_token.observe(state.first_token_time - state.created)


_EXTRA_HELP = {
    "spec_rounds_total": "VeriCache rounds (draft, then verify) completed.",
    "spec_drafted_tokens_total": "Tokens drafted over the compressed KV tier.",
    "spec_accepted_tokens_total": "Drafted tokens the exact-KV verifier accepted.",
    "spec_accept_length": "Mean tokens emitted per VeriCache round (accepted drafts + 1).",
    "spec_draft_forwards_total": "Forward passes with draft rows (DRAFT_DECODE or MIXED).",
    "spec_draft_rows_total": "Draft rows in them: one per drafting request, plus --speculative-ngram proposals.",
    "spec_ngram_proposed_tokens_total": "N-gram proposal tokens the drafter checked (--speculative-ngram).",
    "spec_ngram_accepted_tokens_total": "N-gram proposal tokens that were the drafter's own samples (taken as drafts).",
    "compressed_chunks_total": "Compressed-tier chunks (one KV page each) in the accelerator pool.",
    "compressed_chunks_free": "Compressed-tier chunks free.",
    "compressed_chunks_cached": "Compressed-tier chunks held by the prefix cache.",
    "compressed_bytes_per_chunk": "Bytes one compressed chunk takes (all layers).",
    "compressed_prefix_hit_rate": "Share of queried prompt tokens whose compressed KV came from the cache.",
    # KV store (--kv-store): per tier (exact, compressed) and for the store as a whole.
    **{f"kv_store_{tier}_{name}_total": f"KV store, {tier} tier: {text}"
       for tier in ("exact", "compressed") for name, text in (
           ("pages_hit", "pages loaded into the KV pools."),
           ("pages_missed", "pages past the prefix-cache match the store lacked (or held corrupted)."),
           ("pages_skipped", "stored pages not loaded for lack of KV pool room."),
           ("pages_written", "pages written through after prefill."),
           ("bytes_read", "bytes read from the store."),
           ("bytes_written", "bytes written to the store."),
           ("read_seconds", "seconds spent looking up and loading pages."),
           ("write_seconds", "seconds spent writing pages through."))},
    "kv_store_loaded_tokens_total": "Prompt tokens whose exact KV was loaded from the KV store.",
    "kv_store_errors_total": "KV store calls that failed (each served as a miss: the prefix is recomputed).",
    "kv_store_evictions_total": "KV store entries this instance evicted to stay within --kv-store-capacity.",
    "kv_store_throttle_seconds_total": "Seconds KV store transfers waited on --kv-store-bandwidth.",
    "kv_store_corrupt_pages_total": "KV store pages found corrupted (deleted; their prefix was recomputed).",
    "kv_store_down": "1 while the KV store is unreachable (requests recompute prefixes), else 0.",
}


# (Prometheus name, kind, help, RequestMetrics / SchedulerStats field)
_REQUEST_METRICS = (
    ("num_requests_total", "counter", "Requests finished.", "num_requests_total"),
    ("num_aborted_requests_total", "counter", "Requests aborted.", "num_aborted_requests_total"),
    ("prompt_tokens_total", "counter", "Prompt tokens processed.", "prompt_tokens_total"),
    ("generation_tokens_total", "counter", "Output tokens generated.", "generation_tokens_total"),
    ("cached_tokens_total", "counter", "Prompt tokens served from the prefix cache.", "cached_tokens_total"),
)
_REQUEST_HISTOGRAMS = (
    ("e2e_request_latency_seconds", "End-to-end request latency.", "e2e_latency"),
    ("time_to_first_token_seconds", "Time to the first output token.", "time_to_first_token"),
)
_SCHEDULER_METRICS = (
    ("num_running_reqs", "gauge", "Requests running (decoding or prefilling).", "num_running_reqs"),
    ("num_queue_reqs", "gauge", "Requests waiting in the queue.", "num_waiting_reqs"),
    ("num_used_tokens", "gauge", "KV pool token slots in use.", "num_used_tokens"),
    ("max_total_num_tokens", "gauge", "KV pool token slots.", "max_total_num_tokens"),
    ("token_usage", "gauge", "Fraction of the KV pool in use.", "token_usage"),
    ("cache_hit_rate", "gauge", "Prefix-cache hit rate (cached / prompt tokens).", "cache_hit_rate"),
    ("gen_throughput", "gauge", "Generation throughput (tokens/s, recent window).", "gen_throughput"),
    ("num_retracted_reqs_total", "counter", "Requests retracted under memory pressure.",
     "num_retracted_total"),
)


def render_prometheus(model_name: str, m: RequestMetrics, s: SchedulerStats | None) -> str:
    escaped = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    labels = f'model_name="{escaped}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value) -> None:
        lines.append(f"# HELP sglang:{name} {help_text}")
        lines.append(f"# TYPE sglang:{name} {kind}")
        lines.append(f"sglang:{name}{{{labels}}} {value}")

    for name, kind, help_text, field_name in _REQUEST_METRICS:
        metric(name, kind, help_text, getattr(m, field_name))
    for name, help_text, field_name in _REQUEST_HISTOGRAMS:
        lines.append(f"# HELP sglang:{name} {help_text}")
        lines.append(f"# TYPE sglang:{name} histogram")
        lines.extend(getattr(m, field_name).lines(f"sglang:{name}", labels))
    if s is not None:
        for name, kind, help_text, field_name in _SCHEDULER_METRICS:
            metric(name, kind, help_text, getattr(s, field_name))
        # Tier and VeriCache counters (compressed tier usage, rounds, drafted / accepted tokens).
        for key, value in sorted(s.extra.items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                kind = "counter" if key.endswith("_total") else "gauge"
                metric(key, kind, _EXTRA_HELP.get(key, key.replace("_", " ") + "."), value)
    return "\n".join(lines) + "\n"
