"""ServerArgs: every knob of the runtime, with SGLang's flag names where the concept is the same."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from sglang_vericache.compressor_names import KV_COMPRESSORS  # noqa: F401 (re-exported)
from sglang_vericache.utils.default_model import default_model_path
from sglang_vericache.server_args_checks import (  # noqa: F401 (re-exported: the allowed values and their parsers)
    DEFAULT_KV_COMPRESSION_RATIO,
    DISAGG_PREFILLS,
    DISAGG_ROLES,
    DTYPES,
    KV_STORE_KINDS,
    KV_STORE_TIERS,
    NgramConfig,
    QUANTIZING_COMPRESSORS,
    SCHEDULE_POLICIES,
    ServerArgsChecks,
    check_redis_url,
    default_kv_store_path,
    parse_bytes,
    split_kv_compressor,
)

DEFAULT_CUDA_WATCHDOG_S = 300.0  # SGLang's default


def bundled_model_path() -> str:
    """The bundled code model that ships inside the package (the tests' fast model)."""
    return os.path.join(os.path.dirname(__file__), "assets", "vericache-code-tiny")


@dataclass
class ServerArgs(ServerArgsChecks):
    model_path: str = field(default_factory=default_model_path)
    tokenizer_path: str | None = None
    load_format: str = "auto"  # auto: what model_path holds; safetensors; gguf; dummy: random, config only
    served_model_name: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # dtype of the exact KV pools; auto = --dtype
    device: str = "cpu"
    context_length: int | None = None
    chat_template: str | None = None

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = "info"
    # Output tokens per streaming event (SGLang's --stream-interval); the first token and the finish go
    # out at once.
    stream_interval: int = 1

    # Memory and batching.
    page_size: int = 16
    max_total_tokens: int | None = None
    max_running_requests: int = 64
    chunked_prefill_size: int = 512
    max_prefill_tokens: int = 4096
    disable_radix_cache: bool = False

    # Two-tier KV cache and VeriCache (issues 4-6).
    kv_compressor: str | None = None
    kv_compression_ratio: float = DEFAULT_KV_COMPRESSION_RATIO  # token-dropping compressors only
    # What a token dropper ranks at once (issue 37): page | segment | auto (segment where it can)
    kv_compress_scope: str = "auto"
    kv_compress_segment_tokens: int = 8192  # longest segment (a longer prompt is folded in several)
    kv_recent_window: int = 128  # segment scope: generated tokens kept exact before they are folded
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: str = "16"  # an integer, or "auto" (adapts per request)
    # N-gram proposals checked by the drafter (speculative/ngram.py), SGLang's NGRAM option names.
    speculative_ngram: bool = False
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_branch_length: int = 8
    device_kv_budget: str | None = None  # bytes ("64MB", "2GiB") of accelerator KV memory
    host_kv_budget: str | None = None  # bytes of host memory for the exact tier (VeriCache)
    vericache_schedule: str = "auto"  # adaptive | lockstep | staggered | auto (see `schedule`)
    verify_staging_tokens: int = 16384  # exact-KV rows one streamed verification may stage per layer
    kv_offload: bool = False  # full mode with exact KV in host memory, streamed in every step
    # Two-tier modes: where the exact pool lives (mem_cache/device_page_cache.py). device: on the accelerator
    # (the placement's residency is accounting); host: in host memory (page-locked on CUDA), forwards reading
    # it through an accelerator page cache of exact_kv_cache_tokens (None: the device budget's worth).
    exact_kv_pool: str = "device"
    exact_kv_cache_tokens: int | None = None
    link_bandwidth: str | None = None  # bytes/s ("2GB") of the host->accelerator link; None = unthrottled

    # KV store (issue 8): prompt KV pages in a shared store, found by prefix hash chains.
    kv_store: str = "none"  # none | file | redis
    kv_store_path: str | None = None  # file store directory (default: default_kv_store_path())
    kv_store_url: str = "redis://127.0.0.1:6379/0"
    kv_store_capacity: str | None = None  # bytes ("4GB"); None = unlimited
    kv_store_bandwidth: str | None = None  # bytes/s of the instance<->store link; None = unthrottled
    kv_store_timeout: float = 1.0  # seconds per store call before it counts as down
    kv_store_tiers: str = "auto"  # auto | exact | compressed | both

    # Dual-instance VeriCache (issue 8, disagg/): a drafter instance verifies over ZMQ on a verifier.
    disagg_role: str = "none"  # none | drafter | verifier
    verifier_addr: str | None = None  # drafter: tcp://HOST:PORT of the verifier
    disagg_port: int | None = None  # verifier: the TCP port it binds (on --host)
    disagg_timeout: float = 10.0  # seconds of silence before the peer counts as gone
    disagg_prefill: str = "local"  # drafter: local | verifier (remote prefix caching, disagg/remote_prefill.py)
    disagg_bandwidth: str | None = None  # drafter: bytes/s of its link to the verifier; None = unthrottled
    # both roles: HMAC-SHA256 key of every frame (disagg/wire.py); None = $SGLANG_VERICACHE_DISAGG_SECRET or
    # unauthenticated. repr=False, and /server_info shows only whether it is set.
    disagg_secret: str | None = field(default=None, repr=False)

    # Sampling defaults.
    random_seed: int = 0
    # Batch-invariant arithmetic (layers/batch_invariant.py): None = the default, on in every mode wherever
    # the backend has batch-invariant kernels (deterministic_default); resolved in __post_init__.
    # False: --disable-deterministic-inference.
    enable_deterministic_inference: bool | None = None

    # Attention.
    attention_backend: str = "torch"
    num_threads: int | None = None
    cpu_half_gemm: str = "auto"  # layers/half_gemm.py: auto | native | float32
    # CUDA graphs (model_executor/cuda_graph_runner.py): on CUDA with the triton backend.
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None  # None: min(--max-running-requests, 64)
    cuda_graph_bs: list[int] | None = None  # None: 1, 2, 4, 8, then every 8 up to the max

    # Tool calling and reasoning models (SGLang's parsers).
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # splits <think> text into reasoning_content (OpenAI chat)

    # SGLang launch flags, with the meaning they have here.
    tp_size: int = 1  # tensor parallelism: one scheduler process per rank (distributed/parallel_state.py)
    dist_init_addr: str | None = None  # host:port of the ranks' rendezvous; None: a free local port (one node)
    nnodes: int = 1  # hosts the tp_size ranks are spread over (tp_size / nnodes ranks each)
    node_rank: int = 0  # this host's index; node 0 serves HTTP and runs rank 0
    dist_timeout: float = 600.0  # seconds a collective may wait for a peer rank before the server exits
    dp_size: int = 1  # > 1: that many replicas behind sglang-router (dp/controller.py)
    mem_fraction_static: float | None = None  # device memory for weights + KV pool (SGLang's meaning)
    trust_remote_code: bool = False  # for configs and tokenizers that ship their own code
    quantization: str | None = None  # weight quantization: none supported
    schedule_policy: str = "fcfs"  # fcfs | lpm (longest prefix match first)
    enable_metrics: bool = False  # changes nothing: /metrics is always served; accepted for SGLang command lines
    log_requests: bool = False  # log each request on arrival and on finish
    decode_log_interval: int = 40  # decode iterations between the scheduler's "Decode batch." log lines
    enable_cache_report: bool = False  # OpenAI usage carries prompt_tokens_details.cached_tokens
    sampling_defaults: str = "model"  # model: unset OpenAI sampling knobs from generation_config; openai: OpenAI's
    watchdog_timeout: float | None = None  # seconds one scheduler iteration may run; None: 300 on CUDA, off on CPU

    def __post_init__(self) -> None:
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = self.model_path
        self.validate()
        if self.enable_deterministic_inference is None:
            self.enable_deterministic_inference = self.deterministic_default()

    def deterministic_default(self) -> bool:
        """Deterministic inference unless asked otherwise: on the torch backend on a CPU (the C++
        batch-invariant linear and attention kernels) and on the triton backend on CUDA (Triton matmul and
        fixed-split attention); off on flashinfer (no batch-invariant kernels), the torch backend on CUDA,
        and the triton backend on a CPU (TRITON_INTERPRET, a test vehicle where the Triton matmul would run
        interpreted)."""
        cuda = self.device.startswith("cuda")
        return (self.attention_backend == "torch" and not cuda) or (self.attention_backend == "triton" and cuda)

    @property
    def kv_mode(self) -> str:
        """full: exact KV only; lossy: compressed KV only; vericache: draft compressed, verify exact."""
        if self.speculative_algorithm:
            return "vericache"
        return "lossy" if self.kv_compressor else "full"

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

    @property
    def uses_link(self) -> bool:
        """Whether exact KV is streamed from the host tier over a (possibly throttled) link."""
        return self.kv_offload or (self.kv_mode == "vericache" and (
            self.link_bandwidth is not None or self.staggered or self.adaptive))

    @property
    def kv_store_tier_set(self) -> tuple[str, ...]:
        """Tiers written to and loaded from the KV store. auto: exact in full mode, both in the
        two-tier modes (a tree node always holds exact KV, and prefilling the rest of a prompt
        attends over the exact prefix, so lossy needs exact pages too)."""
        if self.kv_store == "none":
            return ()
        tiers = self.kv_store_tiers
        if tiers == "auto":
            tiers = "exact" if self.kv_mode == "full" else "both"
            if self.disagg_prefill == "verifier":
                tiers = "compressed"  # the drafter never holds a prompt's exact KV
        return ("exact", "compressed") if tiers == "both" else (tiers,)

    @property
    def watchdog_timeout_s(self) -> float | None:
        """The watchdog timeout in force: --watchdog-timeout, else 300 s on CUDA and none on a CPU."""
        if self.watchdog_timeout is not None:
            return self.watchdog_timeout
        return DEFAULT_CUDA_WATCHDOG_S if self.device.startswith("cuda") else None

    @property
    def max_draft_tokens(self) -> int:
        return 32 if self.speculative_num_draft_tokens == "auto" else int(self.speculative_num_draft_tokens)

    def ngram_config(self):
        """The n-gram proposal settings (None without --speculative-ngram)."""
        if not self.speculative_ngram:
            return None
        return NgramConfig(self.speculative_ngram_min_match_window_size,
                           self.speculative_ngram_max_match_window_size, self.speculative_ngram_branch_length)

    def public_dict(self) -> dict:
        """The fields as /server_info and Engine.get_server_info report them: a set --disagg-secret
        reads "<set>", never the secret itself."""
        info = dataclasses.asdict(self)
        if info["disagg_secret"] is not None:
            info["disagg_secret"] = "<set>"
        return info

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Adds every flag to parser (defined in server_args_cli.py)."""
        from sglang_vericache.server_args_cli import add_cli_args

        add_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        kwargs = {}
        for f in dataclasses.fields(cls):
            value = getattr(args, f.name, None)
            if value is not None:
                kwargs[f.name] = value
        return cls(**with_kv_mode(kwargs, getattr(args, "kv_mode", None)))


KV_MODES = ("full", "offload", "lossy", "vericache")


def with_kv_mode(kwargs: dict, kv_mode: str | None) -> dict:
    """ServerArgs keyword arguments with --kv-mode spelled out in the flags that make each mode
    (SGLang's --speculative-algorithm VERICACHE, --kv-offload); a flag that contradicts it is an error."""
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


def prepare_server_args(argv: list[str] | None = None) -> ServerArgs:
    return parse_launch_args(argv)[0]


def parse_launch_args(argv: list[str] | None = None) -> tuple[ServerArgs, argparse.Namespace]:
    """ServerArgs and the whole parsed command line (which also holds sglang-router's
    `--router-*` flags, when the router is installed: dp/router_flags.py)."""
    from sglang_vericache.dp.router_flags import add_router_cli_args

    parser = argparse.ArgumentParser(
        prog="python -m sglang_vericache.launch_server",
        usage="%(prog)s [flags] (--help lists every flag)",
        description="Serve a model with SGLang's HTTP API and OpenAI-compatible endpoints.",
    )
    ServerArgs.add_cli_args(parser)
    add_router_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        return ServerArgs.from_cli_args(args), args
    except ValueError as e:
        parser.error(str(e))
        raise


@dataclass
class PortArgs:
    """ZMQ endpoints between the TokenizerManager and the Scheduler process."""

    scheduler_input_ipc_name: str
    tokenizer_ipc_name: str

    @staticmethod
    def init_new() -> PortArgs:
        import tempfile

        d = tempfile.mkdtemp(prefix="sglang-vericache-")
        return PortArgs(
            scheduler_input_ipc_name=f"ipc://{d}/scheduler_input",
            tokenizer_ipc_name=f"ipc://{d}/tokenizer",
        )
