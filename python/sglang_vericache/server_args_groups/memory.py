"""Memory and scheduling: how much memory KV gets, and how requests are batched.

The exact KV pool's size, by precedence: --max-total-tokens (token slots), then its byte budget
(--device-kv-budget in full mode, --host-kv-budget in the two-tier modes), then (full mode)
--mem-fraction-static, else a quarter of the free memory. The two-tier modes' compressed tier gets
--device-kv-budget, else what --mem-fraction-static leaves after the weights, else twice the exact
pool's pages. (--exact-kv-cache-tokens, in the KV mode group, sizes the accelerator's page cache of a
host exact pool.)
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_vericache.server_args_groups.base import ArgsGroup, arg, flag_of, parse_bytes

SCHEDULE_POLICIES = ("fcfs", "lpm")


@dataclass
class MemoryArgs(ArgsGroup):
    TITLE = "Memory and scheduling"
    DESCRIPTION = ("The exact KV pool's size, by precedence: --max-total-tokens, then --device-kv-budget "
                   "(full mode) or --host-kv-budget (VeriCache, lossy), then --mem-fraction-static (full "
                   "mode), else a quarter of the free memory.")

    page_size: int = arg(16, help="Tokens per KV-cache page.")
    max_total_tokens: int | None = arg(None,
        help="Token slots in the exact KV pool (default: from --device-kv-budget in full mode or "
             "--host-kv-budget in two-tier modes, else a quarter of free RAM, at most 131072).")
    device_kv_budget: str | None = arg(None,  # bytes ("64MB", "2GiB")
        help="Accelerator memory for KV (e.g. 256MB). Full mode keeps exact KV here; VeriCache and lossy "
             "keep the compressed tier, exact tails and verification staging here. Per rank with "
             "--tp-size. Default: none (full mode: see --max-total-tokens; two-tier modes: what "
             "--mem-fraction-static leaves after the weights, else twice the exact pool's pages).")
    host_kv_budget: str | None = arg(None,
        help="Host memory for the exact KV tier in VeriCache mode (e.g. 4GB). Per rank with --tp-size. "
             "Default: none (see --max-total-tokens).")
    mem_fraction_static: float | None = arg(None,  # SGLang's meaning
        help="Fraction of the device's memory (RAM on a CPU) for weights and the KV pool, as in "
             "SGLang: the KV pool gets what is left of it after loading the weights (the exact pool in "
             "full mode, the compressed tier in two-tier modes). --max-total-tokens and "
             "--device-kv-budget take precedence. Default: a quarter of the memory free after loading.")
    max_running_requests: int = arg(64, help="Most requests decoding at once.")
    chunked_prefill_size: int = arg(512,
        help="Most prompt tokens one request prefills per forward pass (longer prompts are chunked).")
    max_prefill_tokens: int = arg(4096, help="Most prompt tokens in one prefill batch.")
    disable_radix_cache: bool = arg(False, help="Do not share prefixes between requests.")
    schedule_policy: str = arg("fcfs", choices=SCHEDULE_POLICIES,
        help="Order of waiting requests: fcfs (arrival) or lpm (longest cached prefix first, so requests "
             "that share a prefix run while it is cached; fcfs beyond 128 waiting).")

    def check(self) -> None:
        self.check_at_least("page_size")
        for name in ("device_kv_budget", "host_kv_budget"):
            if getattr(self, name) is not None:
                parse_bytes(getattr(self, name), flag_of(name))
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        self.check_at_least("max_running_requests")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError(
                f"--chunked-prefill-size ({self.chunked_prefill_size}) must be >= --page-size ({self.page_size})"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ValueError(f"--max-total-tokens must be at least two pages, got {self.max_total_tokens}")
        self.check_choice("schedule_policy", SCHEDULE_POLICIES)
