"""KV mode and compression: which KV tiers serve a request, and what the compressed tier holds.

The mode, stated once. `--kv-mode` is the one flag; SGLang's spellings of each mode are accepted alone
too, and --kv-mode sets them (with_kv_mode):

    --kv-mode    the flags it stands for                              tiers (ServerArgs.kv_mode)
    full         (none)                                               exact KV on the accelerator (full)
    offload      --kv-offload                                         exact KV in host memory, streamed every
                                                                      step (full's tiers: kv_mode "full")
    lossy        --kv-compressor NAME                                 compressed KV only (lossy)
    vericache    --kv-compressor NAME --speculative-algorithm         draft over compressed KV, verify over
                 VERICACHE                                            exact KV (vericache)
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_vericache.compressor_names import QUANTIZING, TOKEN_DROPPING, split_kv_compressor
from sglang_vericache.server_args_groups.base import ArgsGroup, arg, parse_bytes

KV_MODES = ("full", "offload", "lossy", "vericache")
DEFAULT_KV_COMPRESSION_RATIO = 4.0
QUANTIZING_COMPRESSORS = QUANTIZING  # layout "quantized": the bit width fixes the ratio


def with_kv_mode(kwargs: dict, kv_mode: str | None) -> dict:
    """ServerArgs keyword arguments with --kv-mode spelled out in the flags that make each mode (the
    table above); a flag that contradicts it is an error."""
    if kv_mode is None:
        return kwargs
    if kv_mode not in KV_MODES:
        raise ValueError(f"--kv-mode must be one of {', '.join(KV_MODES)}, got {kv_mode!r}")
    compressor, algorithm = kwargs.get("kv_compressor"), kwargs.get("speculative_algorithm")
    if kv_mode in ("full", "offload") and compressor:
        raise ValueError(f"--kv-mode {kv_mode} keeps exact KV only: drop --kv-compressor {compressor} "
                         "(or use --kv-mode lossy / vericache)")
    if kv_mode in ("lossy", "vericache") and not compressor:
        raise ValueError(f"--kv-mode {kv_mode} needs a --kv-compressor (e.g. snapkv, kivi4, int8)")
    if kv_mode != "vericache" and algorithm:
        raise ValueError(f"--speculative-algorithm {algorithm} is --kv-mode vericache, not {kv_mode}")
    if kv_mode != "offload" and kwargs.get("kv_offload"):
        raise ValueError(f"--kv-offload is --kv-mode offload, not {kv_mode}")
    out = dict(kwargs)
    if kv_mode == "vericache":
        out["speculative_algorithm"] = algorithm or "VERICACHE"
    elif kv_mode == "offload":
        out["kv_offload"] = True
    return out


@dataclass
class KVModeArgs(ArgsGroup):
    TITLE = "KV mode and compression (VeriCache)"
    CLI_ONLY = ("kv_mode",)  # spelled out in the fields below by with_kv_mode

    kv_compressor: str | None = arg(None,
        help=f"KV compressor for the compressed tier: a token dropper ({', '.join(TOKEN_DROPPING)}), a "
             f"quantizer ({', '.join(QUANTIZING)}), or DROP+QUANT (e.g. snapkv+kivi4). Alone it serves "
             "from compressed KV (lossy); with --speculative-algorithm VERICACHE it drafts from it and "
             "verifies against exact KV. Default: none (full mode).")
    kv_compression_ratio: float = arg(DEFAULT_KV_COMPRESSION_RATIO,
        help="Compression ratio of token-dropping compressors. Quantizers have the ratio of their bit "
             "width: with them this flag has no effect (a warning says so).")
    # What a token dropper ranks at once (issue 37).
    kv_compress_scope: str = arg("auto", choices=("auto", "page", "segment"),
        help="What a token-dropping compressor ranks at once: page (each page alone, k of every page's "
             "tokens) or segment (a prompt's whole pages after its prefill, with its last queries in "
             "view, and generated tokens in segments past an exact recent window; one budget over the "
             "segment). auto: segment for token droppers (and DROP+QUANT) without a KV store, a "
             "dual-instance role or --speculative-ngram; page otherwise.")
    kv_head_budget: str = arg("auto", choices=("auto", "uniform", "adaptive", "global"),
        help="Segment scope, score-based token droppers (snapkv, pyramidkv, expected_attention, knorm, kvzip, "
             "kvzap): uniform (every KV head keeps the same number of tokens), adaptive (AdaKV / kvpress "
             "AdaKVPress: one top-k over every head's scores in a layer, each head keeping at least 20%% of its "
             "uniform share; the same total per layer) or global (one top-k over every layer's and head's "
             "scores, no safeguard: kvpress KVzipPress, KVzap's one threshold; the same total per segment). "
             "auto: the method's own: global for kvzip, kvzip_proxy and kvzap, uniform for the others and "
             "wherever the method's own cannot run (page scope, DROP+QUANT).")
    kv_compress_segment_tokens: int = arg(8192,
        help="Segment scope: the longest segment in tokens (a longer prompt is folded in several; at "
             "most 32767).")
    kv_recent_window: int = arg(128,
        help="Segment scope: generated tokens kept exact; past twice this, the older whole pages are "
             "folded as one segment, leaving this many exact.")
    kv_keep_recent: int | None = arg(None,
        help="Segment scope, token droppers that rank by a score alone (expected_attention, knorm, kvzip, "
             "kvzap): a segment's last tokens kept first, inside the budget (at most half of what the 4 sinks "
             "leave): a prompt's question, which their papers never compress. 0: the score alone. Default: the "
             "method's own, 128 for kvzap (DMS's sliding window, beside which its paper runs it), 64 for the others.")
    kv_offload: bool = arg(False,
        help="Baseline: full mode with exact KV in host memory, streamed over the link at every step "
             "(= --kv-mode offload).")
    # Two-tier modes: where the exact pool lives (mem_cache/device_page_cache.py). device: on the accelerator
    # (the placement's residency is accounting); host: in host memory (page-locked on CUDA), forwards reading
    # it through an accelerator page cache of exact_kv_cache_tokens (None: the device budget's worth).
    exact_kv_pool: str = arg("device", choices=["device", "host"],
        help="VeriCache and lossy modes: where the exact KV pool lives. device: accelerator memory "
             "(which requests count as resident is accounting); host: host memory (page-locked on CUDA), "
             "every committed token written through to it, forwards reading exact KV through an "
             "accelerator page cache (--exact-kv-cache-tokens) that keeps resident requests' pages and "
             "the others' tail pages.")
    exact_kv_cache_tokens: int | None = arg(None,
        help="With --exact-kv-pool host: tokens of exact KV the accelerator's page cache holds (default: "
             "what --device-kv-budget holds of it, else the whole pool).")
    link_bandwidth: str | None = arg(None,  # bytes/s of the host->accelerator link
        help="Throttle host->accelerator copies of exact KV (verification staging, offload) to this many "
             "bytes per second (e.g. 2GB = 2e9 B/s), so a CPU run has a real slow link. Default: "
             "unthrottled. With --tp-size, each rank has its own link (its KV heads' bytes).")

    @classmethod
    def add_cli_args(cls, add) -> None:
        add("--kv-mode", type=str, default=None, choices=KV_MODES,
            help="full: exact KV on the accelerator (the reference). offload: exact KV in host memory, "
                 "streamed in every step (= --kv-offload). lossy: compressed KV only (= --kv-compressor "
                 "alone). vericache: draft over compressed KV, verify over exact KV, output = full's bitwise "
                 "(= --kv-compressor with --speculative-algorithm VERICACHE). lossy and vericache need "
                 "--kv-compressor. Default: full, or what --kv-compressor / --speculative-algorithm / "
                 "--kv-offload imply.")
        super().add_cli_args(add)

    @property
    def kv_mode(self) -> str:
        """The tiers: full: exact KV only (--kv-offload included); lossy: compressed KV only; vericache:
        draft compressed, verify exact."""
        if self.speculative_algorithm:
            return "vericache"
        return "lossy" if self.kv_compressor else "full"

    @property
    def uses_link(self) -> bool:
        """Whether exact KV is streamed from the host tier over a (possibly throttled) link."""
        return self.kv_offload or (self.kv_mode == "vericache" and (
            self.link_bandwidth is not None or self.staggered or self.adaptive))

    def check(self) -> None:
        if self.exact_kv_pool not in ("device", "host"):
            raise ValueError(f"--exact-kv-pool must be device or host, got {self.exact_kv_pool!r}")
        if self.exact_kv_pool == "host" and self.kv_mode == "full":
            raise ValueError("--exact-kv-pool host is for the two-tier modes (VeriCache, lossy): full mode's "
                             "exact KV is its accelerator tier (--kv-offload is the full-mode offload "
                             "baseline)")
        self.check_at_least("exact_kv_cache_tokens")
        if self.kv_offload and self.kv_mode != "full":
            raise ValueError("--kv-offload is the full-KV offload baseline; VeriCache and lossy modes have "
                             "tiers")
        if self.kv_compressor is not None:
            split_kv_compressor(self.kv_compressor)  # a name or DROP+QUANT; ValueError names the bad part
        if self.kv_head_budget not in ("auto", "uniform", "adaptive", "global"):
            raise ValueError(f"--kv-head-budget must be auto, uniform, adaptive or global, got {self.kv_head_budget!r}")
        if self.kv_compress_scope not in ("auto", "page", "segment"):
            raise ValueError(f"--kv-compress-scope must be auto, page or segment, got {self.kv_compress_scope!r}")
        if not self.page_size <= self.kv_compress_segment_tokens <= 32767:
            raise ValueError(f"--kv-compress-segment-tokens must be in [--page-size, 32767], got "
                             f"{self.kv_compress_segment_tokens}")
        if self.kv_keep_recent is not None and self.kv_keep_recent < 0:
            raise ValueError(f"--kv-keep-recent must be >= 0, got {self.kv_keep_recent}")
        if self.kv_recent_window < 0:
            raise ValueError(f"--kv-recent-window must be >= 0, got {self.kv_recent_window}")
        if not self.kv_compression_ratio >= 1.0:
            raise ValueError(f"--kv-compression-ratio must be >= 1, got {self.kv_compression_ratio}")
        if self.link_bandwidth is not None and parse_bytes(self.link_bandwidth, "--link-bandwidth") <= 0:
            raise ValueError(f"--link-bandwidth must be > 0 bytes/s, got {self.link_bandwidth!r}")

    def warnings(self) -> list[str]:
        if self.kv_compressor in QUANTIZING and self.kv_compression_ratio != DEFAULT_KV_COMPRESSION_RATIO:
            return [f"--kv-compression-ratio {self.kv_compression_ratio:g} has no effect with --kv-compressor "
                    f"{self.kv_compressor}: a quantizer's ratio is fixed by its bit width"]
        return []

