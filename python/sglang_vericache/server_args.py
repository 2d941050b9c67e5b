"""ServerArgs: every knob of the runtime, with SGLang's flag names where the concept is the same."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The compressor registry's names (compress/registry.py; a test keeps the two equal). Listed here
# so that parsing flags never imports torch.
KV_COMPRESSORS = ("streamingllm", "snapkv", "pyramidkv", "h2o", "knorm", "kivi2", "kivi4", "int8", "fp8")


def default_model_path() -> str:
    """The bundled code model that ships inside the package."""
    return os.path.join(os.path.dirname(__file__), "assets", "vericache-code-tiny")


@dataclass
class ServerArgs:
    model_path: str = field(default_factory=default_model_path)
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
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
    kv_compression_ratio: float = 4.0
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: str = "16"  # an integer, or "auto" (adapts per request)
    device_kv_budget: str | None = None  # bytes ("64MB", "2GiB") of accelerator KV memory
    host_kv_budget: str | None = None  # bytes of host memory for the exact tier (VeriCache)
    vericache_schedule: str = "auto"  # lockstep | staggered | auto (staggered iff a link bandwidth is set)
    verify_staging_tokens: int = 16384  # exact-KV rows one streamed verification may stage per layer
    kv_offload: bool = False  # full mode with exact KV in host memory, streamed in every step
    link_bandwidth: str | None = None  # bytes/s ("2GB") of the host->accelerator link; None = unthrottled

    # Sampling defaults.
    random_seed: int = 0

    # Attention.
    attention_backend: str = "torch"
    num_threads: int | None = None

    # Tool calling.
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = self.model_path
        self.validate()

    @property
    def kv_mode(self) -> str:
        """full: exact KV only; lossy: compressed KV only; vericache: draft compressed, verify exact."""
        if self.speculative_algorithm:
            return "vericache"
        return "lossy" if self.kv_compressor else "full"

    @property
    def staggered(self) -> bool:
        if self.kv_mode != "vericache":
            return False
        if self.vericache_schedule == "auto":
            return self.link_bandwidth is not None
        return self.vericache_schedule == "staggered"

    @property
    def uses_link(self) -> bool:
        """Whether exact KV is streamed from the host tier over a (possibly throttled) link."""
        return self.kv_offload or (self.kv_mode == "vericache" and (self.link_bandwidth is not None or self.staggered))

    @property
    def max_draft_tokens(self) -> int:
        return 32 if self.speculative_num_draft_tokens == "auto" else int(self.speculative_num_draft_tokens)

    def validate(self) -> None:
        if self.speculative_algorithm is not None:
            if self.speculative_algorithm.upper() != "VERICACHE":
                raise ValueError(f"--speculative-algorithm must be VERICACHE, got {self.speculative_algorithm!r}")
            self.speculative_algorithm = "VERICACHE"
            if not self.kv_compressor:
                raise ValueError("--speculative-algorithm VERICACHE needs a --kv-compressor to draft with")
        if self.vericache_schedule not in ("auto", "lockstep", "staggered"):
            raise ValueError(f"--vericache-schedule must be auto, lockstep or staggered, got {self.vericache_schedule!r}")
        if self.verify_staging_tokens < 1:
            raise ValueError(f"--verify-staging-tokens must be >= 1, got {self.verify_staging_tokens}")
        if self.kv_offload and self.kv_mode != "full":
            raise ValueError("--kv-offload is the full-KV offload baseline; VeriCache and lossy modes have tiers")
        if self.kv_compressor is not None and self.kv_compressor not in KV_COMPRESSORS:
            raise ValueError(f"--kv-compressor must be one of {', '.join(KV_COMPRESSORS)}, got {self.kv_compressor!r}")
        x = self.speculative_num_draft_tokens
        if x != "auto" and not (str(x).isdigit() and 1 <= int(x) <= 64):
            raise ValueError(f"--speculative-num-draft-tokens must be 1..64 or 'auto', got {x!r}")
        if not self.kv_compression_ratio >= 1.0:
            raise ValueError(f"--kv-compression-ratio must be >= 1, got {self.kv_compression_ratio}")
        for name in ("device_kv_budget", "host_kv_budget", "link_bandwidth"):
            if getattr(self, name) is not None:
                parse_bytes(getattr(self, name), "--" + name.replace("_", "-"))
        if self.link_bandwidth is not None and parse_bytes(self.link_bandwidth) <= 0:
            raise ValueError(f"--link-bandwidth must be > 0 bytes/s, got {self.link_bandwidth!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError(
                f"--chunked-prefill-size ({self.chunked_prefill_size}) must be >= --page-size ({self.page_size})"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ValueError(f"--max-total-tokens must be at least two pages, got {self.max_total_tokens}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = ServerArgs.__dataclass_fields__
        add = parser.add_argument
        add("--model-path", type=str, default=None,
            help="Local Hugging Face model folder (config.json, *.safetensors, tokenizer files). "
                 "Default: the bundled code model.")
        add("--tokenizer-path", type=str, default=None, help="Tokenizer folder (default: --model-path).")
        add("--served-model-name", type=str, default=None, help="Model name reported by /v1/models.")
        add("--skip-tokenizer-init", action="store_true",
            help="Do not load a tokenizer: requests carry input_ids and responses carry output_ids only.")
        add("--dtype", type=str, default=d["dtype"].default, choices=DTYPES,
            help="Weight and activation dtype ('auto' = the checkpoint's torch_dtype, float32 for float32 checkpoints).")
        add("--device", type=str, default=d["device"].default, help="Device to run on: cpu or cuda.")
        add("--context-length", type=int, default=None,
            help="Longest prompt + output a request may have (default: the model's max_position_embeddings).")
        add("--chat-template", type=str, default=None,
            help="A Jinja chat template file that overrides the tokenizer's own.")
        add("--host", type=str, default=d["host"].default, help="HTTP host to bind.")
        add("--port", type=int, default=d["port"].default, help="HTTP port to bind.")
        add("--api-key", type=str, default=None, help="Require 'Authorization: Bearer KEY' on every request.")
        add("--log-level", type=str, default=d["log_level"].default, help="Logging level.")
        add("--stream-interval", type=int, default=d["stream_interval"].default,
            help="Output tokens per streaming event (the first token and the finish are always sent at once).")
        add("--page-size", type=int, default=d["page_size"].default, help="Tokens per KV-cache page.")
        add("--max-total-tokens", type=int, default=None,
            help="Token slots in the exact KV pool (default: from --device-kv-budget in full mode or "
                 "--host-kv-budget in two-tier modes, else a quarter of free RAM, at most 131072).")
        add("--max-running-requests", type=int, default=d["max_running_requests"].default,
            help="Most requests decoding at once.")
        add("--chunked-prefill-size", type=int, default=d["chunked_prefill_size"].default,
            help="Most prompt tokens one request prefills per forward pass (longer prompts are chunked).")
        add("--max-prefill-tokens", type=int, default=d["max_prefill_tokens"].default,
            help="Most prompt tokens in one prefill batch.")
        add("--disable-radix-cache", action="store_true", help="Do not share prefixes between requests.")
        add("--kv-compressor", type=str, default=None,
            help="KV compressor for the compressed tier: streamingllm, snapkv, pyramidkv, h2o, knorm, kivi2, "
                 "kivi4, int8, fp8. Alone it serves from compressed KV (lossy); with "
                 "--speculative-algorithm VERICACHE it drafts from it and verifies against exact KV.")
        add("--kv-compression-ratio", type=float, default=d["kv_compression_ratio"].default,
            help="Compression ratio of token-dropping compressors (quantizers imply their own).")
        add("--speculative-algorithm", type=str, default=None,
            help="VERICACHE: draft over the compressed KV, verify over the exact KV; output equals full KV.")
        add("--speculative-num-draft-tokens", type=str, default=d["speculative_num_draft_tokens"].default,
            help="Draft tokens per VeriCache round (1-64), or 'auto' to adapt per request to its acceptance.")
        add("--device-kv-budget", type=str, default=None,
            help="Accelerator memory for KV (e.g. 256MB). Full mode keeps exact KV here; VeriCache and lossy "
                 "keep the compressed tier, exact tails and verification staging here.")
        add("--host-kv-budget", type=str, default=None,
            help="Host memory for the exact KV tier in VeriCache mode (e.g. 4GB).")
        add("--link-bandwidth", type=str, default=None,
            help="Throttle host->accelerator copies of exact KV (verification staging, offload) to this many "
                 "bytes per second (e.g. 2GB = 2e9 B/s), so a CPU run has a real slow link. Default: unthrottled.")
        add("--vericache-schedule", type=str, default=d["vericache_schedule"].default,
            choices=("auto", "lockstep", "staggered"),
            help="lockstep: all requests draft, then all verify; staggered: each iteration some verify while "
                 "the rest draft, booked against link bandwidth and staging memory; auto: staggered when "
                 "--link-bandwidth is set.")
        add("--verify-staging-tokens", type=int, default=d["verify_staging_tokens"].default,
            help="Exact-KV rows (per layer, double-buffered) that streamed verification may stage on the "
                 "accelerator; also the longest context a request may have when exact KV is streamed.")
        add("--kv-offload", action="store_true",
            help="Baseline: full mode with exact KV in host memory, streamed over the link at every step.")
        add("--random-seed", type=int, default=d["random_seed"].default,
            help="Seed for the server's random choices (seeds of unseeded requests).")
        add("--attention-backend", type=str, default=d["attention_backend"].default,
            help="Attention backend: torch (reference, CPU and CUDA).")
        add("--num-threads", type=int, default=None, help="torch intra-op threads in the scheduler process.")
        add("--tool-call-parser", type=str, default=None,
            help="SGLang function-call parser for OpenAI tools (qwen25, llama3, mistral, pythonic, hermes, ...).")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        kwargs = {}
        for f in dataclasses.fields(cls):
            value = getattr(args, f.name, None)
            if value is not None:
                kwargs[f.name] = value
        return cls(**kwargs)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str | int, flag: str = "size") -> int:
    """'64MB' -> 64_000_000, '2GiB' -> 2**31, '1000' -> 1000."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{flag} must be a size like 512MB or 2GiB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def prepare_server_args(argv: list[str] | None = None) -> ServerArgs:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_vericache.launch_server",
        description="Serve a model with SGLang's HTTP API and OpenAI-compatible endpoints.",
    )
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        return ServerArgs.from_cli_args(args)
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
