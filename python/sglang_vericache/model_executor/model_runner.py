"""ModelRunner: owns the model, the KV pools and the attention backend; runs one forward."""

from __future__ import annotations

import logging

import torch

from sglang_vericache.distributed.parallel_state import get_tp_group
from sglang_vericache.layers.attention.registry import create_attention_backend, get_attention_backend_class
from sglang_vericache.layers.rotary_embedding import RotaryEmbedding
from sglang_vericache.mem_cache.device_page_cache import DevicePageCache, pages_one_forward_touches
from sglang_vericache.mem_cache.kv_stager import LayerwiseKVStager
from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool, PagedTokenAllocator, ReqToTokenPool
from sglang_vericache.mem_cache.transfer_engine import TransferEngine
from sglang_vericache.compress.base import KVZIP_CHUNK_TOKENS
from sglang_vericache.compressor_names import split_kv_compressor
from sglang_vericache.model_config import ModelConfig
from sglang_vericache.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang_vericache.model_executor.forward_batch import ForwardBatch
from sglang_vericache.model_loader.loader import load_model
from sglang_vericache.server_args import ServerArgs, parse_bytes

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOTAL_TOKENS = 2**17
DEFAULT_MEM_FRACTION = 0.25  # of available RAM, when --max-total-tokens is unset


class ModelRunner:
    def __init__(self, server_args: ServerArgs):
        self.server_args = server_args
        self.device = server_args.device
        if server_args.num_threads:
            torch.set_num_threads(server_args.num_threads)
        tp = get_tp_group()
        if tp.size != server_args.tp_size:
            raise RuntimeError(f"--tp-size {server_args.tp_size}, but this process joined a group of {tp.size} ranks")
        tp.deterministic = bool(server_args.enable_deterministic_inference)  # all-reduce in rank order
        self.model_config = ModelConfig.from_server_args(server_args)  # this rank's heads at --tp-size > 1
        self.dtype = self.model_config.dtype
        kv = server_args.kv_cache_dtype
        self.kv_dtype = self.dtype if kv == "auto" else getattr(torch, kv)  # the exact KV pools' dtype
        self.page_size = server_args.page_size
        self.capture_hidden = False  # kvzap's two-tier sets it: captured_q holds attention inputs
        self.model = load_model(
            self.model_config, self.device, server_args.load_format, server_args.random_seed)
        logger.info("serving %s", describe_model(self.model_config, self.model, server_args))
        for rope in (m for m in self.model.modules() if isinstance(m, RotaryEmbedding)):
            rope.reserve(self.model_config.context_len + self.positions_past_context())
        self.half_gemm_float32 = self.init_half_gemm()
        self.batch_invariant_mode = self.init_deterministic_inference()
        self.init_memory_pool()
        self.check_sliding_window()
        self.attn_backend = create_attention_backend(server_args.attention_backend, self)
        self.graph_runner = self.init_cuda_graphs()

    def check_sliding_window(self) -> None:
        """A model with sliding-window layers needs a backend that applies the window (the torch backend)."""
        windows = sorted({m.sliding_window for m in self.model.modules() if getattr(m, "sliding_window", None)})
        backend = get_attention_backend_class(self.server_args.attention_backend)
        if windows and not getattr(backend, "supports_sliding_window", False):
            raise ValueError(
                f"{self.model_config.architecture} ({self.server_args.model_path}) has sliding-window attention "
                f"layers (window {', '.join(map(str, windows))}), which --attention-backend "
                f"{self.server_args.attention_backend} does not implement; use --attention-backend torch")
        if windows:
            logger.info("sliding-window attention: %d of %d layers see the last %s positions",
                        sum(1 for m in self.model.modules() if getattr(m, "sliding_window", None)),
                        self.model_config.num_hidden_layers, "/".join(map(str, windows)))

    def init_half_gemm(self) -> bool:
        """--cpu-half-gemm: half-precision linear layers through float32 products (layers/half_gemm.py);
        -> whether they are. Only with deterministic inference off (its CPU kernel multiplies the stored
        dtype in float32 already) and not with the triton backend (its own matmul kernel)."""
        from sglang_vericache.layers import half_gemm

        args = self.server_args
        if args.enable_deterministic_inference:
            if args.cpu_half_gemm == "float32":
                logger.info("--cpu-half-gemm float32: not needed under deterministic inference (its CPU linear "
                            "kernel accumulates half-precision weights in float32, without copies)")
            return False
        if args.attention_backend == "triton" or not half_gemm.use_float32(self.model, args.cpu_half_gemm, self.device):
            return False
        nbytes = half_gemm.enable_float32_gemm(self.model)
        logger.info("linear layers: %s weights multiplied in float32 (--cpu-half-gemm %s; copies take %.1f MB)",
                    self.dtype, args.cpu_half_gemm, nbytes / 2**20)
        return True

    def init_deterministic_inference(self) -> tuple[str, int] | None:
        """Deterministic inference (on unless --disable-deterministic-inference): batch-invariant linear
        layers and attention (built now, so the first request does not wait for the kernels' compiler).
        -> the linear mode, or None."""
        if not self.server_args.enable_deterministic_inference:
            logger.warning("deterministic inference: OFF (--disable-deterministic-inference): outputs may change "
                           "with batch composition (other requests, chunking, cache hits), and VeriCache / lossy "
                           "output need not equal full mode's")
            return None
        from sglang_vericache.layers.batch_invariant import enable_batch_invariance, uses_triton_row_kernels

        backend = self.server_args.attention_backend
        if backend == "triton":  # Triton kernels: batch_invariant_matmul and fixed_split_attention
            mode = enable_batch_invariance(self.model, backend)
            rows = ("Triton RMSNorm and sampler log_softmax" if uses_triton_row_kernels(True, backend, self.device)
                    else "torch's per-row RMSNorm and log_softmax (CPU)")
            logger.info("deterministic inference: on (triton backend: batch-invariant Triton matmul; "
                        "fixed-split attention, chunks of 64 keys; %s)", rows)
            return mode
        from sgl_kernel_ext import cpu_attention

        cpu_attention.load()
        mode = enable_batch_invariance(self.model)
        logger.info("deterministic inference: on (linear layers: packed float32-accumulation kernel; fixed-chunk "
                    "attention); --disable-deterministic-inference turns it off")
        return mode

    def batch_invariant_linear_name(self) -> str | None:
        """/server_info's name for the linear mode: "packed x16" (cpu_linear), "triton" (batch_invariant_matmul),
        or None."""
        mode = self.batch_invariant_mode
        if mode is None:
            return None
        return mode[0] if mode[0] == "triton" else "%s x%d" % mode

    def positions_past_context(self) -> int:
        """Columns req_to_token keeps past the context: 64, and for kvzip over segments (any
        --kv-compress-scope but page) its replay of a chunk (KVZIP_CHUNK_TOKENS and its repeat
        prompt) after the segment."""
        args = self.server_args
        if (args.kv_compressor and "kvzip" in split_kv_compressor(args.kv_compressor)
                and args.kv_compress_scope != "page"):
            return 64 + KVZIP_CHUNK_TOKENS + 64
        return 64

    def init_memory_pool(self) -> None:
        cfg, args, ps = self.model_config, self.server_args, self.page_size
        self.req_to_token_pool = ReqToTokenPool(
            size=args.max_running_requests + 8, max_context_len=cfg.context_len + self.positions_past_context(),
            device=self.device,
        )
        bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
        bytes_per_token *= torch.tensor([], dtype=self.kv_dtype).element_size()
        # The exact pool is the accelerator's in full mode and the host tier in two-tier modes
        # (where the accelerator budget goes to the compressed tier instead).
        on_device = args.kv_mode == "full" and not args.kv_offload
        exact_budget = args.device_kv_budget if on_device else args.host_kv_budget
        # --mem-fraction-static: what the fraction leaves after the weights, for the accelerator's KV.
        self.static_kv_bytes = None
        if args.mem_fraction_static is not None:
            self.static_kv_bytes = static_kv_bytes(args.mem_fraction_static, *_memory(self.device))
        if args.max_total_tokens is not None:
            max_tokens, why = args.max_total_tokens, "--max-total-tokens"
        elif exact_budget is not None:
            max_tokens = parse_bytes(exact_budget) // bytes_per_token
            why = f"--{'device' if on_device else 'host'}-kv-budget {exact_budget}"
        elif on_device and self.static_kv_bytes is not None:
            max_tokens = self.static_kv_bytes // bytes_per_token
            why = f"--mem-fraction-static {args.mem_fraction_static}: what it leaves after the weights"
        else:
            available = _memory(self.device)[1]
            budget = int(available * DEFAULT_MEM_FRACTION)
            max_tokens = min(DEFAULT_MAX_TOTAL_TOKENS, budget // bytes_per_token)
            why = (f"{DEFAULT_MEM_FRACTION:.0%} of the {available / 2**30:.1f} GiB available"
                   + (f", capped at {DEFAULT_MAX_TOTAL_TOKENS} tokens" if max_tokens == DEFAULT_MAX_TOTAL_TOKENS else "")
                   + "; set --max-total-tokens or --mem-fraction-static to change it")
        self.exact_bytes_per_token = bytes_per_token
        max_tokens = get_tp_group().min_over_ranks(max_tokens)  # free memory differs between ranks
        num_pages = max_tokens // ps
        if num_pages < 2:
            raise ValueError(f"KV pool too small: {max_tokens} tokens is under two pages of {ps}")
        self.max_total_num_tokens = num_pages * ps
        self.token_to_kv_pool_allocator = PagedTokenAllocator(num_pages, ps, device=self.device)
        host_pool = args.exact_kv_pool == "host"
        self.token_to_kv_pool = MHATokenToKVPool(
            num_slots=(num_pages + 1) * ps,  # + page 0, the padding page
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=self.kv_dtype,
            device="cpu" if host_pool else self.device,
            pin_memory=host_pool and self.device.startswith("cuda"),
        )
        logger.info(
            "KV pool: %d tokens (%d pages of %d), %.1f MiB%s, %d bytes a token (%s): %s",
            self.max_total_num_tokens, num_pages, ps, self.max_total_num_tokens * bytes_per_token / 2**20,
            " in host memory" if host_pool else "", bytes_per_token, "exact KV" if on_device else
            "the exact tier", why,
        )
        # --exact-kv-pool host: forwards read and write exact KV through the accelerator's page cache.
        self.exact_cache: DevicePageCache | None = None
        if host_pool:
            tokens = args.exact_kv_cache_tokens
            if tokens is None and args.device_kv_budget is not None:
                tokens = parse_bytes(args.device_kv_budget) // bytes_per_token
            cache_pages = min(num_pages, -(-tokens // ps)) if tokens is not None else num_pages
            # Besides the resident requests' contexts (the placement's budget, within the device budget), one
            # forward's pages; VeriCache without a link verifies every request over the cache: the whole pool.
            whole = args.kv_mode == "vericache" and not args.uses_link
            least = num_pages if whole else pages_one_forward_touches(args.chunked_prefill_size,
                                                                      args.max_running_requests, ps)
            if cache_pages < min(least, num_pages):
                raise ValueError(
                    f"--exact-kv-cache-tokens {cache_pages * ps} is too small: a forward may touch "
                    f"{min(least, num_pages) * ps} tokens of exact KV here"
                    + (" (without a link every request verifies over the cache, which then holds the whole pool: "
                       "set --link-bandwidth or a staggered / adaptive schedule)" if whole else ""))
            self.exact_cache = DevicePageCache(self.token_to_kv_pool, cache_pages, ps, self.req_to_token_pool.size,
                                               self.req_to_token_pool.max_context_len, self.device)
            self.token_to_kv_pool_allocator.on_free = self.exact_cache.invalidate
            logger.info("exact KV cache on %s: %d pages of %d (%.1f MiB)", self.device, cache_pages, ps,
                        cache_pages * ps * bytes_per_token / 2**20)

    def init_cuda_graphs(self) -> CudaGraphRunner | None:
        args = self.server_args
        if args.disable_cuda_graph or not self.device.startswith("cuda") or self.exact_cache is not None:
            return None
        if args.tp_size > 1:
            logger.info("CUDA graphs: not captured with --tp-size > 1 (collectives run eagerly)")
            return None
        if args.attention_backend != "triton":
            logger.info("CUDA graphs: captured with --attention-backend triton only; %s runs eagerly",
                        args.attention_backend)
            return None
        if args.enable_deterministic_inference:
            logger.info("CUDA graphs: not captured under deterministic inference (its attention plans per "
                        "forward); decode runs eagerly (--disable-deterministic-inference captures them)")
            return None
        return CudaGraphRunner(self)

    def init_kv_stager(self, max_tokens: int, depth: int = 2) -> LayerwiseKVStager:
        """The transfer engine (throttled to --link-bandwidth) and a layer-wise stager over the exact
        pool (the host tier) for streamed verification: self.transfer_engine, self.kv_stager."""
        bw = self.server_args.link_bandwidth
        bandwidth = None if bw is None else float(parse_bytes(bw, "--link-bandwidth"))
        if getattr(self, "transfer_engine", None) is None:
            self.transfer_engine = TransferEngine(bandwidth, self.device)
        self.kv_stager = LayerwiseKVStager(self.token_to_kv_pool, self.transfer_engine, max_tokens, depth)
        return self.kv_stager

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """-> float32 logits [n_rows, vocab] for the rows in forward_batch.logits_indices
        (None: each request's last token; in DECODE and DRAFT_DECODE, row i = request i).
        Rows index the batch's tokens in batch order: request by request, and in a MIXED batch the
        num_draft draft rows (one token each) first, then each staged request's new tokens.
        A DRAFT_DECODE / MIXED batch brings its own draft_ctx (compressed pool, tail, draft pool); a
        batch with `staged` brings a begun StagedKV, which this forward consumes (every layer is
        released; on an error the StagedKV is closed, so the stager is free again either way)."""
        cache = self.exact_cache
        kv = cache.pool if cache is not None else self.token_to_kv_pool  # the exact KV the forward reads
        fb = forward_batch.to(kv.get_key_buffer(0).device)
        fb.req_to_token_pool, fb.token_to_kv_pool = self.req_to_token_pool, kv
        host_loc = fb.out_cache_loc
        if cache is not None:  # the batch's tables in cache slots, its pages resident
            view = cache.view(fb, self.req_to_token_pool.req_to_token)
            fb.req_to_token_pool, fb.out_cache_loc = view, view.out_cache_loc
        fb.attn_backend = self.attn_backend
        fb.capture_hidden = self.capture_hidden
        try:
            logits = self._forward(fb)
            if cache is not None:  # the host pool holds every row the forward wrote
                cache.write_back(view, host_loc)
            return logits
        finally:
            fb.out_cache_loc = host_loc  # the caller's batch keeps its host slots
            if fb.staged is not None and not fb.staged.kv.finished:
                fb.staged.kv.close()

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        with torch.inference_mode():
            if self.graph_runner is not None and self.graph_runner.can_run(fb):
                logits = self.graph_runner.replay(fb)
                if logits is not None:
                    return logits
            self.attn_backend.init_forward_metadata(fb)
            hidden = self.model.forward(fb.input_ids, fb.positions, fb)
            rows = fb.logits_indices if fb.logits_indices is not None else fb.last_token_indices()
            one_row_each = fb.forward_mode.is_decode() or fb.forward_mode.is_draft_decode()
            if not (one_row_each and fb.logits_indices is None):
                hidden = hidden.index_select(0, rows.to(hidden.device))
            return self.model.compute_logits(hidden)


def _memory(device: str) -> tuple[int, int]:
    """(total, available) bytes of the device's memory: CUDA memory, or RAM on a CPU."""
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        return total, free
    import psutil

    vm = psutil.virtual_memory()
    return vm.total, vm.available


def static_kv_bytes(fraction: float, total: int, available: int) -> int:
    """SGLang's --mem-fraction-static, measured after the weights are loaded: weights + KV pool
    may use `fraction` of the device's memory, and what is in use already (weights, and anything
    else on the device) counts against it. The KV cache gets the rest."""
    in_use = total - available
    rest = int(total * fraction) - in_use
    if rest <= 0:
        gib = 2**30
        raise ValueError(
            f"--mem-fraction-static {fraction} leaves no memory for the KV cache: {in_use / gib:.1f} GiB of "
            f"{total / gib:.1f} GiB is in use after loading the weights; raise the fraction (or set "
            "--max-total-tokens)")
    return rest


def describe_model(cfg: ModelConfig, model: torch.nn.Module, args: ServerArgs) -> str:
    """One line on what is served: model, architecture, parameters, context, dtype, KV mode."""
    import os

    params = sum(p.numel() for p in model.parameters())  # a tied LM head is counted once
    name = os.path.basename(os.path.normpath(cfg.model_path))
    from sglang_vericache.server_args import QUANTIZING_COMPRESSORS

    mode = args.kv_mode
    if args.kv_compressor:
        ratio = "" if args.kv_compressor in QUANTIZING_COMPRESSORS else f" {args.kv_compression_ratio:g}x"
        mode += f" ({args.kv_compressor}{ratio})"
    return (f"{name}: {cfg.architecture}, {params / 1e6:.1f}M parameters, {cfg.num_hidden_layers} layers, "
            f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads of {cfg.head_dim}, "
            f"context {cfg.context_len}, {str(cfg.dtype).removeprefix('torch.')}, KV mode {mode}"
            + (f", tp {cfg.tp_size}" if cfg.tp_size > 1 else ""))
