"""Kernels and determinism (attention backend, batch-invariant arithmetic, threads, CUDA graphs) and
logging and metrics."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from sglang_vericache.server_args_groups.base import ArgsGroup, arg

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
logger = logging.getLogger("sglang_vericache.server_args")  # startup notes read as ServerArgs'


@dataclass
class KernelArgs(ArgsGroup):
    TITLE = "Kernels and determinism"

    attention_backend: str = arg("torch",
        help="Attention backend: torch (reference, CPU and CUDA), triton (sgl-kernel-ext kernels; "
             "CUDA, or a CPU with TRITON_INTERPRET=1 for tests), flashinfer (NVIDIA GPU).")
    # Batch-invariant arithmetic (layers/batch_invariant.py): None = the default, on in every mode wherever
    # the backend has batch-invariant kernels (deterministic_default); resolved in __post_init__.
    # False: --disable-deterministic-inference.
    enable_deterministic_inference: bool | None = arg(None, action=argparse.BooleanOptionalAction,
        help="Batch-invariant inference (the default): every token row is computed by the same "
             "arithmetic whatever shares its batch (linear layers as one float32 accumulation per output "
             "in a fixed order, attention reduced in fixed chunks of keys), so a prompt's output (tokens "
             "and logprobs) is the same alone or under load, chunked or not, cache hit or miss, and "
             "VeriCache / lossy output equals full mode's bitwise in every dtype. Default: on with the "
             "torch backend on a CPU and the triton backend on CUDA (Triton matmul and fixed-split "
             "attention; no CUDA graphs); off on flashinfer. Accepted for SGLang command lines; "
             "--disable-deterministic-inference (or --no-enable-deterministic-inference) turns it off.",
        also=(("--disable-deterministic-inference", dict(action="store_const", const=False, default=None,
            help="Turn deterministic inference off (default: on, see --enable-deterministic-inference): "
                 "library matrix products (and CUDA graphs), faster on some machines, but outputs may then "
                 "change with batch composition and VeriCache / lossy output need not equal full mode's (a "
                 "startup warning says so).")),))
    num_threads: int | None = arg(None,
        help="torch intra-op threads in the scheduler process (default: torch's, one per core).")
    cpu_half_gemm: str = arg("auto", choices=("auto", "native", "float32"),  # layers/half_gemm.py
        help="With deterministic inference off: how bfloat16 / float16 linear layers multiply on a CPU: "
             "native (torch's half GEMM); float32 (each weight also kept in float32, 4 more bytes per "
             "parameter; products accumulated in float32 and rounded once to the model dtype, 4-7x "
             "faster on CPUs without AVX512-BF16/AMX); auto (float32 on a CPU without half-precision dot "
             "products while the copies take under a quarter of free memory). Ignored under "
             "deterministic inference, whose kernel reads the weights in their own dtype.")
    # CUDA graphs (model_executor/cuda_graph_runner.py): on CUDA with the triton backend.
    disable_cuda_graph: bool = arg(False,
        help="Run decode and draft steps eagerly. By default, on CUDA with --attention-backend triton, "
             "each batch size's DECODE / DRAFT_DECODE forward is captured as a CUDA graph on first use "
             "and replayed (batches padded up to the next captured size).")
    cuda_graph_max_bs: int | None = arg(None,
        help="Largest batch size captured (default: min(--max-running-requests, 64)); larger batches "
             "run eagerly. CUDA with --attention-backend triton only (elsewhere: a warning).")
    cuda_graph_bs: list[int] | None = arg(None,
        help="The batch sizes captured (default: 1 2 4 8, then every 8 up to --cuda-graph-max-bs). CUDA "
             "with --attention-backend triton only (elsewhere: a warning).")

    def deterministic_default(self) -> bool:
        """Deterministic inference unless asked otherwise: on the torch backend on a CPU (the C++
        batch-invariant linear and attention kernels) and on the triton backend on CUDA (Triton matmul and
        fixed-split attention); off on flashinfer (no batch-invariant kernels), the torch backend on CUDA,
        and the triton backend on a CPU (TRITON_INTERPRET, a test vehicle where the Triton matmul would run
        interpreted)."""
        cuda = self.device.startswith("cuda")
        return (self.attention_backend == "torch" and not cuda) or (self.attention_backend == "triton" and cuda)

    def check(self) -> None:
        if self.enable_deterministic_inference:
            self.check_deterministic_backend()
        if self.cpu_half_gemm not in ("auto", "native", "float32"):
            raise ValueError(f"--cpu-half-gemm must be auto, native or float32, got {self.cpu_half_gemm!r}")
        self.check_at_least("num_threads")
        self.check_at_least("cuda_graph_max_bs")
        if self.cuda_graph_bs is not None and (not self.cuda_graph_bs or min(self.cuda_graph_bs) < 1):
            raise ValueError(f"--cuda-graph-bs must be batch sizes >= 1, got {self.cuda_graph_bs}")

    def check_deterministic_backend(self) -> None:
        """Deterministic inference runs on the torch backend (CPU: the C++ fixed-chunk kernel) and the
        triton backend (CUDA, or a CPU under TRITON_INTERPRET=1: Triton fixed-split attention and
        batch-invariant matmul); not on flashinfer."""
        backend, cuda = self.attention_backend, self.device.startswith("cuda")
        if backend == "flashinfer":
            raise ValueError("--enable-deterministic-inference is not available with --attention-backend "
                             "flashinfer (its prefill and decode kernels reduce keys in different orders, so "
                             "a verify row would not equal the decode row); use --attention-backend triton")
        if backend == "torch" and cuda:
            raise ValueError("--enable-deterministic-inference on CUDA needs --attention-backend triton (the "
                             "torch backend's batch-invariant attention is a CPU kernel)")

    def warnings(self) -> list[str]:
        graph_flags = [flag for flag, value in (("--cuda-graph-max-bs", self.cuda_graph_max_bs),
                                                ("--cuda-graph-bs", self.cuda_graph_bs)) if value is not None]
        why = None
        if not self.device.startswith("cuda"):
            why = f"CUDA graphs are captured on CUDA only (--device {self.device})"
        elif self.attention_backend != "triton":
            why = f"CUDA graphs are captured with --attention-backend triton only (got {self.attention_backend})"
        elif self.disable_cuda_graph:
            why = "--disable-cuda-graph is set"
        return [] if why is None else [f"{flag} has no effect: {why}" for flag in graph_flags]


@dataclass
class LoggingArgs(ArgsGroup):
    TITLE = "Logging and metrics"

    log_level: str = arg("info", help=f"Logging level: {', '.join(LOG_LEVELS)}.")
    log_requests: bool = arg(False,
        help="Log every request when it arrives (sizes, sampling parameters) and when it finishes "
             "(tokens, finish reason, text).")
    decode_log_interval: int = arg(40,
        help="Decode iterations between the scheduler's \"Decode batch.\" log lines (running and waiting "
             "requests, KV use of each tier, generation throughput); each prefill batch logs a "
             "\"Prefill batch.\" line. Shown at --log-level info.")
    enable_metrics: bool = arg(False,  # SGLang's flag
        help="SGLang's switch for Prometheus metrics at /metrics, which are always on here (default: on, "
             "whether or not the flag is given); accepted so that SGLang command lines run.")

    def check(self) -> None:
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        self.check_at_least("decode_log_interval")

    def log_notes(self) -> None:
        if self.enable_metrics:
            logger.info("--enable-metrics: /metrics is always served here; the flag changes nothing")
