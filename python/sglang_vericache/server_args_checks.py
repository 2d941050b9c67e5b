"""The checks of ServerArgs: each flag's allowed values, the cross-flag rules (validate, run by
ServerArgs.__post_init__) and the flags given a value that has no effect (flag_warnings).

ServerArgs (server_args.py) inherits them from ServerArgsChecks and re-exports every name here, so
`from sglang_vericache.server_args import parse_bytes, DTYPES, ...` keeps working; this module
imports nothing from server_args.py.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

# The compressor registry's names and the DROP+QUANT rule, torch-free (tests keep them equal to
# compress/registry.py); QUANTIZING_COMPRESSORS: layout "quantized", the bit width fixes the ratio.
from sglang_vericache.compressor_names import split_kv_compressor
from sglang_vericache.compressor_names import QUANTIZING as QUANTIZING_COMPRESSORS

logger = logging.getLogger("sglang_vericache.server_args")  # startup warnings read as ServerArgs'

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_KV_COMPRESSION_RATIO = 4.0
KV_STORE_KINDS = ("none", "file", "redis")  # = mem_cache.storage.KV_STORE_KINDS
KV_STORE_TIERS = ("auto", "exact", "compressed", "both")
DISAGG_ROLES = ("none", "drafter", "verifier")  # dual-instance VeriCache (issue 8, disagg/)
SCHEDULE_POLICIES = ("fcfs", "lpm")
DISAGG_PREFILLS = ("local", "verifier")


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


def default_kv_store_path() -> str:
    """Where --kv-store file keeps its pages when --kv-store-path is not given."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "sglang-vericache", "kv-store")


def check_redis_url(url: str) -> None:
    """Raises ValueError naming the flag unless url is a Redis URL redis-py can connect with."""
    from urllib.parse import urlparse

    try:
        u = urlparse(url)
        port = u.port
    except ValueError as e:
        raise ValueError(f"--kv-store-url {url!r} is not a valid URL: {e}") from None
    ok = (u.scheme in ("redis", "rediss") and bool(u.hostname)) or (u.scheme == "unix" and bool(u.path))
    db = u.path.strip("/") if u.scheme != "unix" else ""
    if not ok or (db and not db.isdigit()) or port == 0:
        raise ValueError(f"--kv-store-url must look like redis://HOST:PORT/DB (or rediss://, unix://PATH), got {url!r}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str | int, flag: str = "size") -> int:
    """'64MB' -> 64_000_000, '2GiB' -> 2**31, '1000' -> 1000."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{flag} must be a size like 512MB or 2GiB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class ServerArgsChecks:
    """The validation half of ServerArgs (a mixin: every attribute it reads is a ServerArgs field or
    property). validate() raises ValueError naming the flag; it may fill in a derived default
    (--kv-store-path, --disagg-secret from the environment, the canonical --speculative-algorithm)."""

    def flag_warnings(self) -> list[str]:
        """Flags given a value that has no effect with the rest of the command line, each named."""
        out = []
        graph_flags = [flag for flag, value in (("--cuda-graph-max-bs", self.cuda_graph_max_bs),
                                                ("--cuda-graph-bs", self.cuda_graph_bs)) if value is not None]
        why = None
        if not self.device.startswith("cuda"):
            why = f"CUDA graphs are captured on CUDA only (--device {self.device})"
        elif self.attention_backend != "triton":
            why = f"CUDA graphs are captured with --attention-backend triton only (got {self.attention_backend})"
        elif self.disable_cuda_graph:
            why = "--disable-cuda-graph is set"
        if why is not None:
            out += [f"{flag} has no effect: {why}" for flag in graph_flags]
        if self.kv_compressor in QUANTIZING_COMPRESSORS and self.kv_compression_ratio != DEFAULT_KV_COMPRESSION_RATIO:
            out.append(f"--kv-compression-ratio {self.kv_compression_ratio:g} has no effect with --kv-compressor "
                       f"{self.kv_compressor}: a quantizer's ratio is fixed by its bit width")
        if self.kv_store != "none" and self.disable_radix_cache:
            out.append(f"--kv-store {self.kv_store} with --disable-radix-cache: pages are written to the store "
                       "but never read (loaded pages live in the radix tree)")
        return out

    def log_flag_warnings(self) -> list[str]:
        """Logs flag_warnings() (once, at startup) and a note on --enable-metrics."""
        warnings = self.flag_warnings()
        for message in warnings:
            logger.warning(message)
        if self.enable_metrics:
            logger.info("--enable-metrics: /metrics is always served here; the flag changes nothing")
        return warnings

    def validate(self) -> None:
        self.validate_sglang_flags()
        if self.chat_template is not None:
            self.validate_chat_template()
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
        if self.vericache_schedule not in ("adaptive", "auto", "lockstep", "staggered"):
            raise ValueError("--vericache-schedule must be adaptive, lockstep or staggered, got "
                             f"{self.vericache_schedule!r}")
        if self.enable_deterministic_inference:
            self.validate_deterministic_backend()
        if self.verify_staging_tokens < 1:
            raise ValueError(f"--verify-staging-tokens must be >= 1, got {self.verify_staging_tokens}")
        if self.exact_kv_pool not in ("device", "host"):
            raise ValueError(f"--exact-kv-pool must be device or host, got {self.exact_kv_pool!r}")
        if self.exact_kv_pool == "host" and self.kv_mode == "full":
            raise ValueError("--exact-kv-pool host is for the two-tier modes (VeriCache, lossy): full mode's exact "
                             "KV is its accelerator tier (--kv-offload is the full-mode offload baseline)")
        if self.exact_kv_cache_tokens is not None and self.exact_kv_cache_tokens < 1:
            raise ValueError(f"--exact-kv-cache-tokens must be >= 1, got {self.exact_kv_cache_tokens}")
        if self.kv_offload and self.kv_mode != "full":
            raise ValueError("--kv-offload is the full-KV offload baseline; VeriCache and lossy modes have tiers")
        if self.kv_compressor is not None:
            split_kv_compressor(self.kv_compressor)  # a name or DROP+QUANT; ValueError names the bad part
        x = self.speculative_num_draft_tokens
        if x != "auto" and not (str(x).isdigit() and 1 <= int(x) <= 64):
            raise ValueError(f"--speculative-num-draft-tokens must be 1..64 or 'auto', got {x!r}")
        if self.kv_compress_scope not in ("auto", "page", "segment"):
            raise ValueError(f"--kv-compress-scope must be auto, page or segment, got {self.kv_compress_scope!r}")
        if not self.page_size <= self.kv_compress_segment_tokens <= 32767:
            raise ValueError(f"--kv-compress-segment-tokens must be in [--page-size, 32767], got "
                             f"{self.kv_compress_segment_tokens}")
        if self.kv_recent_window < 0:
            raise ValueError(f"--kv-recent-window must be >= 0, got {self.kv_recent_window}")
        if not self.kv_compression_ratio >= 1.0:
            raise ValueError(f"--kv-compression-ratio must be >= 1, got {self.kv_compression_ratio}")
        for name in ("device_kv_budget", "host_kv_budget", "link_bandwidth"):
            if getattr(self, name) is not None:
                parse_bytes(getattr(self, name), "--" + name.replace("_", "-"))
        if self.link_bandwidth is not None and parse_bytes(self.link_bandwidth) <= 0:
            raise ValueError(f"--link-bandwidth must be > 0 bytes/s, got {self.link_bandwidth!r}")
        self.validate_kv_store()
        self.validate_disagg()
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"--load-format must be auto, safetensors, gguf or dummy, got {self.load_format!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.cpu_half_gemm not in ("auto", "native", "float32"):
            raise ValueError(f"--cpu-half-gemm must be auto, native or float32, got {self.cpu_half_gemm!r}")
        if self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.attention_backend != "torch":
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} needs --attention-backend torch "
                             f"(the {self.attention_backend} backend reads KV in the compute dtype)")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.decode_log_interval < 1:
            raise ValueError(f"--decode-log-interval must be >= 1, got {self.decode_log_interval}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_bs is not None and (not self.cuda_graph_bs or min(self.cuda_graph_bs) < 1):
            raise ValueError(f"--cuda-graph-bs must be batch sizes >= 1, got {self.cuda_graph_bs}")
        if self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError(
                f"--chunked-prefill-size ({self.chunked_prefill_size}) must be >= --page-size ({self.page_size})"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ValueError(f"--max-total-tokens must be at least two pages, got {self.max_total_tokens}")

    def validate_deterministic_backend(self) -> None:
        """--enable-deterministic-inference runs on the torch backend (CPU: the C++ fixed-chunk kernel)
        and the triton backend (CUDA, or a CPU under TRITON_INTERPRET=1: Triton fixed-split attention
        and batch-invariant matmul); not on flashinfer."""
        backend, cuda = self.attention_backend, self.device.startswith("cuda")
        if backend == "flashinfer":
            raise ValueError("--enable-deterministic-inference is not available with --attention-backend flashinfer "
                             "(its prefill and decode kernels reduce keys in different orders, so a verify row "
                             "would not equal the decode row); use --attention-backend triton")
        if backend == "torch" and cuda:
            raise ValueError("--enable-deterministic-inference on CUDA needs --attention-backend triton (the torch "
                             "backend's batch-invariant attention is a CPU kernel)")

    def validate_chat_template(self) -> None:
        """--chat-template must be a readable Jinja file: checked at launch, not on the first chat."""
        path = self.chat_template
        if not os.path.isfile(path):
            raise ValueError(f"--chat-template {path}: no such file (give a Jinja chat template file)")
        import jinja2

        try:
            with open(path) as f:
                jinja2.Environment().parse(f.read())
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {path}: cannot be read: {e}") from None
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"--chat-template {path}: not a valid Jinja template: {e.message} "
                             f"(line {e.lineno})") from None

    def validate_tensor_parallel(self) -> None:
        if self.tp_size < 1 or self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size}, --nnodes {self.nnodes}, --node-rank {self.node_rank}: "
                             "need tp_size >= 1, nnodes >= 1 and 0 <= node_rank < nnodes")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--nnodes {self.nnodes} must divide --tp-size {self.tp_size} (ranks per node)")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the ranks' "
                             "rendezvous)")
        if self.dist_init_addr is not None and not self.dist_init_addr.rpartition(":")[2].isdigit():
            raise ValueError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")
        if self.dist_timeout <= 0:
            raise ValueError(f"--dist-timeout must be > 0 seconds, got {self.dist_timeout}")
        if self.tp_size == 1:
            return
        for flag, on, why in (
            ("--vericache-schedule adaptive", self.adaptive, "its controller decides from each rank's own timings"),
            ("--disagg-role", self.disagg_role != "none", "dual-instance VeriCache runs one rank per instance"),
            ("--kv-store", self.kv_store != "none", "each rank would store its own heads under the same keys"),
        ):
            if on:
                raise ValueError(f"{flag} is not supported with --tp-size {self.tp_size} ({why})")

    def validate_sglang_flags(self) -> None:
        self.validate_tensor_parallel()
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, got {self.dp_size}")
        if self.dp_size > 1 and self.disagg_role == "verifier":
            raise ValueError("--dp-size with --disagg-role verifier: a verifier serves no HTTP for a router; "
                             "start one verifier process per drafter instead")
        if self.dp_size > 1 and self.dist_init_addr is not None:
            raise ValueError("--dist-init-addr with --dp-size > 1: every replica's ranks would meet at that one "
                             "address; leave it unset (each replica's ranks then meet on a free local port)")
        if self.watchdog_timeout is not None and self.watchdog_timeout <= 0:
            raise ValueError(f"--watchdog-timeout must be > 0 seconds, got {self.watchdog_timeout}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.quantization is not None:
            raise ValueError(f"--quantization {self.quantization}: quantized weights are not supported; "
                             "serve a float32/bfloat16/float16 checkpoint (quantized KV: --kv-compressor kivi4)")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"--schedule-policy must be one of {', '.join(SCHEDULE_POLICIES)}, "
                             f"got {self.schedule_policy!r}")
        if self.reasoning_parser is not None:
            from sglang.srt.parser.reasoning_parser import ReasoningParser

            if self.reasoning_parser not in ReasoningParser.DetectorMap:
                names = ", ".join(sorted(ReasoningParser.DetectorMap))
                raise ValueError(f"--reasoning-parser must be one of {names}; got {self.reasoning_parser!r}")

    def validate_kv_store(self) -> None:
        if self.kv_store not in KV_STORE_KINDS:
            raise ValueError(f"--kv-store must be one of {', '.join(KV_STORE_KINDS)}, got {self.kv_store!r}")
        if self.kv_store_tiers not in KV_STORE_TIERS:
            raise ValueError(f"--kv-store-tiers must be one of {', '.join(KV_STORE_TIERS)}, got {self.kv_store_tiers!r}")
        if self.kv_store_path is not None and self.kv_store != "file":
            raise ValueError(f"--kv-store-path is for --kv-store file (got --kv-store {self.kv_store})")
        if self.kv_store == "none":
            return
        if self.kv_store == "file" and not self.kv_store_path:
            self.kv_store_path = default_kv_store_path()
        if self.kv_store == "redis":
            check_redis_url(self.kv_store_url)
        for name in ("kv_store_capacity", "kv_store_bandwidth"):
            value = getattr(self, name)
            if value is not None and parse_bytes(value, "--" + name.replace("_", "-")) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value!r}")
        if not self.kv_store_timeout > 0:
            raise ValueError(f"--kv-store-timeout must be > 0 seconds, got {self.kv_store_timeout}")
        if self.kv_mode == "full" and self.kv_store_tiers in ("compressed", "both"):
            raise ValueError(f"--kv-store-tiers {self.kv_store_tiers} needs a compressed tier (--kv-compressor); "
                             "full mode stores only the exact tier")

    def validate_disagg(self) -> None:
        """Dual-instance mode (disagg/): what each role needs, and what it cannot combine with."""
        role = self.disagg_role
        if role not in DISAGG_ROLES:
            raise ValueError(f"--disagg-role must be one of {', '.join(DISAGG_ROLES)}, got {role!r}")
        if not self.disagg_timeout > 0:
            raise ValueError(f"--disagg-timeout must be > 0 seconds, got {self.disagg_timeout}")
        if self.verifier_addr is not None and role != "drafter":
            raise ValueError("--verifier-addr is for --disagg-role drafter")
        if self.disagg_port is not None and role != "verifier":
            raise ValueError("--disagg-port is for --disagg-role verifier")
        if self.disagg_secret is None and role != "none":
            self.disagg_secret = os.environ.get("SGLANG_VERICACHE_DISAGG_SECRET") or None
        if self.disagg_secret is not None:
            if role == "none":
                raise ValueError("--disagg-secret is for --disagg-role drafter or verifier")
            if not self.disagg_secret:
                raise ValueError("--disagg-secret must not be empty")
        if self.disagg_prefill not in DISAGG_PREFILLS:
            raise ValueError(f"--disagg-prefill must be one of {', '.join(DISAGG_PREFILLS)}, "
                             f"got {self.disagg_prefill!r}")
        if self.disagg_bandwidth is not None:
            if role != "drafter":
                raise ValueError("--disagg-bandwidth is for --disagg-role drafter")
            parse_bytes(self.disagg_bandwidth, "--disagg-bandwidth")
        if self.disagg_prefill == "verifier":
            if role != "drafter":
                raise ValueError("--disagg-prefill verifier is for --disagg-role drafter")
            if self.kv_store_tiers in ("exact", "both"):
                raise ValueError("--disagg-prefill verifier: the drafter never holds a prompt's exact KV, so its "
                                 "--kv-store-tiers can only be compressed (or auto)")
        if role == "drafter":
            from urllib.parse import urlparse

            addr = self.verifier_addr
            if addr is None:
                raise ValueError("--disagg-role drafter needs --verifier-addr tcp://HOST:PORT")
            try:
                u = urlparse(addr)
                ok = u.scheme == "tcp" and bool(u.hostname) and u.port is not None and u.port > 0
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"--verifier-addr must look like tcp://HOST:PORT, got {addr!r}")
            if self.kv_mode != "vericache":
                raise ValueError("--disagg-role drafter drafts: it needs --speculative-algorithm VERICACHE "
                                 "and a --kv-compressor")
            if self.uses_link or self.vericache_schedule in ("adaptive", "staggered"):
                raise ValueError("--disagg-role drafter verifies remotely, in lock-step rounds: --link-bandwidth, "
                                 "--vericache-schedule adaptive / staggered and --kv-offload do not apply")
        if role == "verifier":
            if self.disagg_port is None or not 0 < self.disagg_port < 65536:
                raise ValueError(f"--disagg-role verifier needs --disagg-port 1..65535, got {self.disagg_port}")
            if self.kv_mode != "full" or self.kv_offload:
                raise ValueError("--disagg-role verifier keeps exact KV only: drop --kv-compressor, "
                                 "--speculative-algorithm and --kv-offload")
