"""The compressor contract: config, static per-layer layouts, compressed chunks, the ABC.

A compressor maps ONE page-aligned chunk of T exact tokens of ONE layer (post-RoPE K/V,
plus the chunk's own trailing queries where the method needs them) to a `CompressedChunk`.
Chunk-locality is what lets a shared prefix's compressed KV be reused as is.

    +--------------------------------------------------------------------------------+
    | Layout invariant: for a given (config, layer_id) every CompressedChunk holds   |
    | exactly the tensors of `layout(layer_id).tensors` (same names, shapes, dtypes) |
    | whatever the data, so a pool can be preallocated from the layouts alone.       |
    | decompress() returns float32 (k, v) of shape [layout.rows, H_kv, D]; attention |
    | over the compressed tier is a plain softmax over these rows (RoPE is applied). |
    | Batching: k, v, q, positions may carry the same leading dims [..., T, H, D]    |
    | (N chunks of one layer in one call); every stored tensor and decompress()      |
    | output then has those leading dims in front of the layout's shapes.            |
    +--------------------------------------------------------------------------------+
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch

LayoutKind = Literal["token_drop", "quantized"]


# KVzap's surrogate, in the checkpoint's folder (compress/kvzap.py); CompressorConfig points at it.
SURROGATE_FILE = os.path.join("kvzap", "surrogate.safetensors")


def surrogate_path(model_path: str | None) -> str | None:
    """<folder>/kvzap/surrogate.safetensors; a single .gguf file's sits beside it, named after it:
    <dir>/kvzap/<file stem>.safetensors (one folder may hold several GGUF checkpoints)."""
    if model_path is None:
        return None
    if model_path.endswith(".gguf") and not os.path.isdir(model_path):
        folder, name = os.path.split(model_path)
        return os.path.join(folder, "kvzap", name[: -len(".gguf")] + ".safetensors")
    return os.path.join(model_path, SURROGATE_FILE)


def surrogate_owner(path: str) -> str:
    """The checkpoint (folder or .gguf file) whose surrogate_path is path."""
    folder, name = os.path.split(path)
    top = os.path.dirname(folder)
    if name == os.path.basename(SURROGATE_FILE):
        return top
    return os.path.join(top, name[: -len(".safetensors")] + ".gguf")


KVZIP_CHUNK_TOKENS = 2048  # kvzip over a segment: context tokens per replay pass (kvpress's chunk_size)

@dataclass
class CompressorConfig:
    name: str
    ratio: float  # R >= 1; token-drop methods keep floor(T / R) rows per head (>= 1)
    chunk_size: int  # T, a multiple of the page size
    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16  # the exact tier's dtype (token-drop rows are stored in it)
    sm_scale: float | None = None  # attention scale for query-based scores; None -> 1/sqrt(head_dim)
    # streamingllm
    num_sink_tokens: int = 4
    # snapkv / pyramidkv
    # observation window; None: 8 queries for a page (capped at T), 64 for a segment (kvpress SnapKVPress's)
    window_size: int | None = None
    kernel_size: int = 5  # odd; 1 disables pooling
    pooling: Literal["avg", "max"] = "avg"
    pyramid_beta: int = 20  # smallest layer budget = ceil(mean budget / beta), as PyramidKV's beta
    # h2o
    h2o_recent_fraction: float = 0.5  # share of the budget given to the chunk's most recent tokens
    # kivi, rotatekv
    group_size: int = 32  # G: kivi's tokens per key group and channels per value group; rotatekv's channels
    # expected_attention
    n_future_positions: int = 512  # future query positions the expected RoPE rotation is averaged over
    # kvzip
    kvzip_prompt_tokens: int = 8  # length of the repeat prompt before the reconstructed chunk (proxy offset)
    # token droppers over a segment: "uniform" (every KV head keeps the same count), "adaptive" (AdaKV:
    # one top-k over the layer's (head, token) scores, each head keeping at least alpha_safeguard of its
    # uniform share) or "global" (one top-k over every layer's (head, token) scores, no safeguard: KVzipPress,
    # KVzap's threshold); compress/head_budget.py
    head_budget: Literal["uniform", "adaptive", "global"] = "uniform"
    # segment scope: a method with layer budgets of its own per segment (PyramidKV, global head budgets) has its
    # segment's chunks dealt to the layers (mem_cache/compressed_pool.compress_segment), so every layer's
    # layout holds the mean budget; False (page scope): each layer's rows per page are its layout's
    segment_layers: bool = False
    alpha_safeguard: float = 0.20  # kvpress AdaKVPress's default
    # token droppers that rank by a score alone (expected_attention, knorm, kvzip, kvzap): a segment's last
    # keep_recent tokens are kept first, inside the budget (TokenDropCompressor.protected); None: the
    # method's own (TokenDropCompressor.default_keep_recent)
    keep_recent: int | None = None
    # kvquant
    outlier_fraction: float = 0.01  # share of each chunk's K (and V) values kept exact in a sparse side list
    kmeans_iters: int = 8  # Lloyd iterations fitting the chunk's non-uniform levels
    # kvzap: its surrogate's file (from_model_config: kvzap/surrogate.safetensors in the checkpoint's folder)
    kvzap_path: str | None = None
    # token droppers: layers whose attention reads only a sliding window of recent keys (Gemma 3's sliding
    # layers); they keep their most recent tokens, the only ones the window reads again (from_model_config)
    sliding_layers: tuple[int, ...] = ()
    # RoPE of the model (kvquant, rotatekv: pre-RoPE keys; expected_attention, kvzip: positions), as
    # layers/rotary_embedding.get_rope_parameters gives it; None -> default RoPE, theta 10000
    rope_parameters: dict | None = None

    def __post_init__(self) -> None:
        if self.ratio < 1:
            raise ValueError(f"ratio must be >= 1, got {self.ratio}")
        if self.chunk_size < 1 or self.num_layers < 1 or self.head_dim < 1 or self.num_kv_heads < 1:
            raise ValueError("chunk_size, num_layers, num_kv_heads and head_dim must be >= 1")
        if self.num_q_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_q_heads {self.num_q_heads} is not a multiple of {self.num_kv_heads}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd and >= 1, got {self.kernel_size}")
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"pooling must be 'avg' or 'max', got {self.pooling!r}")
        if ((self.window_size is not None and self.window_size < 1) or self.group_size < 1 or self.pyramid_beta < 1
                or self.num_sink_tokens < 0 or (self.keep_recent is not None and self.keep_recent < 0)):
            raise ValueError("window_size, group_size and pyramid_beta must be >= 1, num_sink_tokens and "
                             "keep_recent >= 0")
        if not 0 <= self.h2o_recent_fraction <= 1:
            raise ValueError(f"h2o_recent_fraction must be in [0, 1], got {self.h2o_recent_fraction}")
        if not 0 <= self.outlier_fraction < 1:
            raise ValueError(f"outlier_fraction must be in [0, 1), got {self.outlier_fraction}")
        if self.head_budget not in ("uniform", "adaptive", "global"):
            raise ValueError(f"head_budget must be 'uniform', 'adaptive' or 'global', got {self.head_budget!r}")
        if not 0 <= self.alpha_safeguard <= 1:
            raise ValueError(f"alpha_safeguard must be in [0, 1], got {self.alpha_safeguard}")
        if self.n_future_positions < 1 or self.kvzip_prompt_tokens < 0 or self.kmeans_iters < 0:
            raise ValueError("n_future_positions must be >= 1, kvzip_prompt_tokens and kmeans_iters >= 0")

    @staticmethod
    def from_model_config(
        name: str, ratio: float, chunk_size: int, model_config, dtype: torch.dtype | None = None, **options
    ) -> CompressorConfig:
        """Shape, exact dtype and RoPE from a ModelConfig (num_hidden_layers, num_key_value_heads, ...,
        hf_config); dtype: the exact tier's when it differs from the model's (--kv-cache-dtype)."""
        m = model_config
        if getattr(m, "hf_config", None) is not None and "rope_parameters" not in options:
            from sglang_vericache.layers.rotary_embedding import get_rope_parameters

            # Gemma 3's RoPE differs per layer kind: the global layers' (one table for every layer;
            # docs/DESIGN.md, "Gemma 3: sliding and global layers")
            options["rope_parameters"] = get_rope_parameters(m.hf_config, layer_type="full_attention")
        hf = getattr(m, "hf_config", None)
        if getattr(hf, "layer_types", None) and "sliding_layers" not in options:
            # the model's own rule, where layer kinds are mixed (a window on every layer, as Mistral's, is not)
            from sglang_vericache.models.llama import layer_sliding_window

            options["sliding_layers"] = tuple(i for i in range(len(hf.layer_types)) if layer_sliding_window(hf, i))
        if getattr(m, "model_path", None) and "kvzap_path" not in options:
            options["kvzap_path"] = surrogate_path(m.model_path)
        return CompressorConfig(
            name,
            ratio=ratio,
            chunk_size=chunk_size,
            num_layers=m.num_hidden_layers,
            num_kv_heads=m.num_key_value_heads,
            num_q_heads=m.num_attention_heads,
            head_dim=m.head_dim,
            dtype=m.dtype if dtype is None else dtype,
            **options,
        )

    @property
    def budget(self) -> int:
        """Mean kept rows per head per chunk for token-drop methods: floor(T / R), at least 1."""
        return max(1, int(self.chunk_size // self.ratio))

    @property
    def scale(self) -> float:
        return self.sm_scale if self.sm_scale is not None else 1.0 / math.sqrt(self.head_dim)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Layout:
    """What one compressed chunk of one layer stores. Static: no data-dependent sizes."""

    kind: LayoutKind
    chunk_size: int  # T exact tokens in
    rows: int  # rows decompress() returns per KV head: T for quantizers, k_l for token drop and drop+quantize
    tensors: tuple[TensorSpec, ...]

    def chunk_nbytes(self) -> int:
        return sum(t.nbytes() for t in self.tensors)

    def bytes_per_token(self) -> float:
        """Stored bytes (scales and indices included) per exact token of this layer."""
        return self.chunk_nbytes() / self.chunk_size


@dataclass
class CompressedChunk:
    tensors: dict[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def to(self, device: torch.device | str) -> CompressedChunk:
        return CompressedChunk({n: t.to(device) for n, t in self.tensors.items()})

    def batch_shape(self, layout: Layout) -> tuple[int, ...]:
        """Leading dims in front of the layout's per-chunk shapes (() for one chunk)."""
        spec = layout.tensors[0]
        return tuple(self.tensors[spec.name].shape[: -len(spec.shape)])

    def matches(self, layout: Layout) -> bool:
        """Same tensor names and dtypes as the layout, its shapes behind one common batch shape."""
        if {s.name for s in layout.tensors} != self.tensors.keys():
            return False
        lead = self.batch_shape(layout)
        return all(
            tuple(self.tensors[s.name].shape) == lead + s.shape and self.tensors[s.name].dtype == s.dtype
            for s in layout.tensors
        )


def exact_bytes_per_token(config: CompressorConfig) -> int:
    """Bytes one token's exact K and V take in one layer."""
    return 2 * config.num_kv_heads * config.head_dim * torch.empty((), dtype=config.dtype).element_size()


class KVCompressor(ABC):
    name: str = ""
    # True: compress() takes, as q, the model runner's kvzip.ReconstructionPass of the chunks (a
    # forward of its own over the exact KV, compress/kvzip_reconstruction.py), not prefill queries.
    needs_reconstruction: bool = False

    def __init__(self, config: CompressorConfig):
        self.config = config

    @abstractmethod
    def layout(self, layer_id: int) -> Layout: ...

    def query_window(self, layer_id: int) -> int:
        """How many trailing queries of the chunk compress() needs: 0, W or T."""
        return 0

    @abstractmethod
    def compress(
        self,
        layer_id: int,
        k: torch.Tensor,  # [..., T, H_kv, D] post-RoPE, exact dtype
        v: torch.Tensor,  # [..., T, H_kv, D]
        q: torch.Tensor | None = None,  # [..., query_window(layer_id), H_q, D] post-RoPE, or None
        positions: torch.Tensor | None = None,  # [..., T] int64 absolute positions of the chunk
    ) -> CompressedChunk: ...

    @abstractmethod
    def decompress(self, layer_id: int, chunk: CompressedChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (k, v), each [..., layout(layer_id).rows, H_kv, D]."""

    def bytes_per_token(self) -> float:
        """Stored bytes per exact token, summed over all layers."""
        return sum(self.layout(i).bytes_per_token() for i in range(self.config.num_layers))

    def effective_ratio(self) -> float:
        """Exact-tier bytes / compressed-tier bytes, over all layers."""
        return exact_bytes_per_token(self.config) * self.config.num_layers / self.bytes_per_token()

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        c = self.config
        want = (c.chunk_size, c.num_kv_heads, c.head_dim)
        if k.dim() < 3 or tuple(k.shape[-3:]) != want or k.shape != v.shape:
            raise ValueError(f"{self.name}: k, v must be [..., *{want}], got {list(k.shape)} {list(v.shape)}")

    def _check_q(self, layer_id: int, q: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
        c = self.config
        want = (*k.shape[:-3], self.query_window(layer_id), c.num_q_heads, c.head_dim)
        if q is None or tuple(q.shape) != want:
            got = None if q is None else list(q.shape)
            raise ValueError(f"{self.name}: needs the chunk's trailing queries q {list(want)}, got {got}")
        return q
