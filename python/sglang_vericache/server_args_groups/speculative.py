"""Speculative decoding: VeriCache's rounds (SGLang's --speculative-* names), their schedule, and the
n-gram proposals the drafter checks."""

from __future__ import annotations

from dataclasses import dataclass

from sglang_vericache.server_args_groups.base import ArgsGroup, arg

VERICACHE_SCHEDULES = ("adaptive", "auto", "lockstep", "staggered")
AUTO_MAX_DRAFT_TOKENS = 32  # --speculative-num-draft-tokens auto: the longest round it may choose


@dataclass(frozen=True, slots=True)
class NgramConfig:
    """N-gram drafting's settings (speculative/ngram.py): --speculative-ngram-min-match-window-size /
    -max-match-window-size / -branch-length."""

    min_window: int = 1
    max_window: int = 12
    branch_length: int = 8  # the most proposal tokens one draft forward checks per request

    def __post_init__(self) -> None:
        if not 1 <= self.min_window <= self.max_window <= 64:
            raise ValueError("--speculative-ngram-min-match-window-size / -max-match-window-size must "
                             f"satisfy 1 <= min <= max <= 64, got {self.min_window} / {self.max_window}")
        if not 1 <= self.branch_length <= 64:
            raise ValueError(f"--speculative-ngram-branch-length must be 1..64, got {self.branch_length}")


def parse_draft_tokens(value: str | int) -> int | None:
    """--speculative-num-draft-tokens, parsed (the one place it is): an integer 1..64, or None for 'auto'."""
    if value == "auto":
        return None
    if not (str(value).isdigit() and 1 <= int(value) <= 64):
        raise ValueError(f"--speculative-num-draft-tokens must be 1..64 or 'auto', got {value!r}")
    return int(value)


@dataclass
class SpeculativeArgs(ArgsGroup):
    TITLE = "Speculative decoding (VeriCache rounds)"

    speculative_algorithm: str | None = arg(None,
        help="VERICACHE: draft over the compressed KV, verify over the exact KV; output equals full KV "
             "(SGLang's spelling of --kv-mode vericache; needs --kv-compressor). Default: none.")
    speculative_num_draft_tokens: str = arg("16",  # an integer, or "auto": parse_draft_tokens
        help=f"Draft tokens per VeriCache round (1-64), or 'auto' to adapt per request to its acceptance "
             f"(rounds of up to {AUTO_MAX_DRAFT_TOKENS}).")
    # N-gram proposals checked by the drafter (speculative/ngram.py), SGLang's NGRAM option names.
    speculative_ngram: bool = arg(False,
        help="VeriCache: look each request's newest tokens up in its own prompt and output (an n-gram "
             "index) and let the compressed-KV drafter check the continuation found there, several "
             "tokens in one draft forward; it keeps the tokens it would have drafted one at a time "
             "anyway, so the drafts, the verification and the output are unchanged, with fewer draft "
             "forwards. Any checkpoint.")
    speculative_ngram_min_match_window_size: int = arg(1,
        help="--speculative-ngram: the fewest newest tokens that must match earlier text to propose "
             "(1-64).")
    speculative_ngram_max_match_window_size: int = arg(12,
        help="--speculative-ngram: the most newest tokens matched; the longest window that matches wins "
             "(1-64).")
    speculative_ngram_branch_length: int = arg(8,
        help="--speculative-ngram: the most proposal tokens one draft forward checks per request (1-64; "
             "also at most the round's drafts left less one). One chain per request (SGLang's BFS "
             "breadth 1).")
    vericache_schedule: str = arg("auto", choices=VERICACHE_SCHEDULES,  # auto: see `schedule`
        help="adaptive: per request, exact KV stays in device memory while the budget holds it, and a "
             "controller fitted to measured step costs picks decoding like full mode or VeriCache rounds "
             "(and their length) and admits host-tier requests only while they add throughput; lockstep: "
             "all requests draft, then all verify; staggered: each iteration some verify while the rest "
             "draft, booked against link bandwidth and staging memory (lockstep and staggered: fixed "
             "policies, for benchmarks); auto (default): adaptive, lockstep on a --disagg-role drafter "
             "and at --tp-size > 1.")
    verify_staging_tokens: int = arg(16384,
        help="Exact-KV rows (per layer, double-buffered) that streamed verification may stage on the "
             "accelerator; also the longest context a request may have when exact KV is streamed.")

    def check(self) -> None:
        if self.speculative_algorithm is not None:
            if self.speculative_algorithm.upper() != "VERICACHE":
                raise ValueError(f"--speculative-algorithm must be VERICACHE, got {self.speculative_algorithm!r}")
            self.speculative_algorithm = "VERICACHE"
            if not self.kv_compressor:
                raise ValueError("--speculative-algorithm VERICACHE needs a --kv-compressor to draft with")
        if self.speculative_ngram:
            if self.kv_mode != "vericache":
                raise ValueError("--speculative-ngram checks n-gram proposals with the compressed-KV "
                                 "drafter: it needs --speculative-algorithm VERICACHE and a --kv-compressor "
                                 "(a verifier never drafts: pass it to the drafter)")
            self.ngram_config()  # ValueError names a bad window or branch length
        if self.vericache_schedule not in VERICACHE_SCHEDULES:
            raise ValueError("--vericache-schedule must be adaptive, lockstep or staggered, got "
                             f"{self.vericache_schedule!r}")
        self.check_at_least("verify_staging_tokens")
        parse_draft_tokens(self.speculative_num_draft_tokens)

    @property
    def draft_tokens(self) -> int | None:
        """Draft tokens per round: fixed, or None for 'auto' (DraftLengthPolicy adapts it per request)."""
        return parse_draft_tokens(self.speculative_num_draft_tokens)

    @property
    def max_draft_tokens(self) -> int:
        """The longest round: the fixed length, or AUTO_MAX_DRAFT_TOKENS under 'auto'."""
        fixed = self.draft_tokens
        return AUTO_MAX_DRAFT_TOKENS if fixed is None else fixed

    @property
    def schedule(self) -> str | None:
        """The VeriCache schedule in force (None outside VeriCache). auto is adaptive, except where its
        controller cannot run: on a remote drafter (disagg/remote_verify.py drives its rounds) and at
        --tp-size > 1 (the controller would decide from one rank's timings); those run lock-step."""
        if self.kv_mode != "vericache":
            return None
        if self.vericache_schedule != "auto":
            return self.vericache_schedule
        return "lockstep" if self.disagg_role == "drafter" or self.tp_size > 1 else "adaptive"

    @property
    def staggered(self) -> bool:
        return self.schedule == "staggered"

    @property
    def adaptive(self) -> bool:
        """VeriCache driven by the adaptive controller (speculative/adaptive.py)."""
        return self.schedule == "adaptive"

    def ngram_config(self):
        """The n-gram proposal settings (None without --speculative-ngram)."""
        if not self.speculative_ngram:
            return None
        return NgramConfig(self.speculative_ngram_min_match_window_size,
                           self.speculative_ngram_max_match_window_size, self.speculative_ngram_branch_length)
