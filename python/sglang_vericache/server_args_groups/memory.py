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

from sglang_vericache.server_args_groups.base import ArgsGroup, flag_of, parse_bytes

SCHEDULE_POLICIES = ("fcfs", "lpm")


@dataclass
class MemoryArgs(ArgsGroup):
    TITLE = "Memory and scheduling"
    DESCRIPTION = ("The exact KV pool's size, by precedence: --max-total-tokens, then --device-kv-budget "
                   "(full mode) or --host-kv-budget (VeriCache, lossy), then --mem-fraction-static (full "
                   "mode), else a quarter of the free memory.")

    page_size: int = 16
    max_total_tokens: int | None = None
    device_kv_budget: str | None = None  # bytes ("64MB", "2GiB") of accelerator KV memory
    host_kv_budget: str | None = None  # bytes of host memory for the exact tier (VeriCache)
    mem_fraction_static: float | None = None  # device memory for weights + KV pool (SGLang's meaning)
    max_running_requests: int = 64
    chunked_prefill_size: int = 512
    max_prefill_tokens: int = 4096
    disable_radix_cache: bool = False
    schedule_policy: str = "fcfs"  # fcfs | lpm (longest prefix match first)

    @classmethod
    def add_cli_args(cls, add) -> None:
        cls.flag(add, "page_size", int, help="Tokens per KV-cache page.")
        cls.flag(add, "max_total_tokens", int,
            help="Token slots in the exact KV pool (default: from --device-kv-budget in full mode or "
                 "--host-kv-budget in two-tier modes, else a quarter of free RAM, at most 131072).")
        cls.flag(add, "device_kv_budget", str,
            help="Accelerator memory for KV (e.g. 256MB). Full mode keeps exact KV here; VeriCache and lossy "
                 "keep the compressed tier, exact tails and verification staging here. Per rank with "
                 "--tp-size. Default: none (full mode: see --max-total-tokens; two-tier modes: what "
                 "--mem-fraction-static leaves after the weights, else twice the exact pool's pages).")
        cls.flag(add, "host_kv_budget", str,
            help="Host memory for the exact KV tier in VeriCache mode (e.g. 4GB). Per rank with --tp-size. "
                 "Default: none (see --max-total-tokens).")
        cls.flag(add, "mem_fraction_static", float,
            help="Fraction of the device's memory (RAM on a CPU) for weights and the KV pool, as in "
                 "SGLang: the KV pool gets what is left of it after loading the weights (the exact pool in "
                 "full mode, the compressed tier in two-tier modes). --max-total-tokens and "
                 "--device-kv-budget take precedence. Default: a quarter of the memory free after loading.")
        cls.flag(add, "max_running_requests", int, help="Most requests decoding at once.")
        cls.flag(add, "chunked_prefill_size", int,
            help="Most prompt tokens one request prefills per forward pass (longer prompts are chunked).")
        cls.flag(add, "max_prefill_tokens", int, help="Most prompt tokens in one prefill batch.")
        add("--disable-radix-cache", action="store_true", help="Do not share prefixes between requests.")
        cls.flag(add, "schedule_policy", str, choices=SCHEDULE_POLICIES,
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
