"""KVQuant 3/4-bit, chunk-local: pre-RoPE per-channel keys, per-token values, non-uniform levels
fitted on the chunk, dense-and-sparse outliers kept exact (Hooper et al., 2024).

Layout of one chunk of one layer (T tokens, or k_l kept rows when it follows a dropper):
  k_codes  uint8 [T, H, D*b/8]  b-bit level indices of the pre-RoPE keys (8 codes per b bytes)
  k_scale, k_zero  f16 [H, D]   per channel (over the chunk's T tokens): x_norm = (x - zero) / scale
  k_levels f16 [2^b]            the chunk's key levels in [-1, 1] (one set per layer and chunk)
  k_out_val [N_o] exact dtype, k_out_idx [N_o] int16/int32: the N_o = round(f * T*H*D) most
                                outlying pre-RoPE key values and their flat index into [T, H, D]
  v_codes, v_scale, v_zero [T, H] (per token and head), v_levels, v_out_val, v_out_idx: values alike
  pos      int32 [T] (or [T, H] after a dropper): positions, to put RoPE back on the keys
"""

from __future__ import annotations

import torch

from sglang_vericache.compress.base import CompressedChunk, KVCompressor, Layout, TensorSpec
from sglang_vericache.compress.quant import F16_TINY, f16_at_least, pack_bits, unpack_bits
from sglang_vericache.compress.rope import ChunkRope


class KVQuantCompressor(KVCompressor):
    """Per chunk, for keys (after undoing RoPE at their positions) and values alike:

    1. Dense-and-sparse: within each vector (a key channel over the chunk's tokens; a value
       token-head over its D channels) a value's outlyingness is |x - median| / MAD of its vector;
       the N_o most outlying values of the chunk (ties: lower flat index) are stored exactly.
    2. Each vector's remaining values are normalized to [-1, 1]: zero = (max + min) / 2 rounded to
       float16, scale = (max - min) / 2 + |rounding of zero|, rounded up to float16.
    3. Non-uniform levels: 2^b levels from a 1-D k-means (Lloyd, quantile start, `kmeans_iters`
       steps) over the chunk's normalized non-outliers, stored as float16; each value gets the
       index of its nearest stored level (ties to the lower level).
    Decompress: level * scale + zero, outliers written back, RoPE re-applied to keys (float32).

    Departures from the paper: the levels are fitted per chunk on its own values, unweighted (the
    paper calibrates one sensitivity-weighted, Fisher-information k-means datatype per layer
    offline); key channel ranges and outlier thresholds are the chunk's own (the paper calibrates
    the keys' offline); the outlier budget is a fixed count per chunk (a static layout) instead of
    per-vector thresholds; no attention-sink token in fp16 (the first chunk is quantized as any
    other); no Q-norm correction.
    """

    takes_kept_rows_positions = True

    def __init__(self, config, bits: int, per_head_positions: bool = False):
        super().__init__(config)
        if bits not in (2, 3, 4):
            raise ValueError(f"kvquant supports 2, 3 or 4 bits, got {bits}")
        c = config
        if c.head_dim % 8:
            raise ValueError(f"kvquant{bits}: head_dim {c.head_dim} must be a multiple of 8 (code packing)")
        self.bits, self.num_levels = bits, 1 << bits
        self.name = f"kvquant{bits}"
        self.per_head_positions = per_head_positions  # [T, H] positions: the kept rows of a dropper
        self.rope = ChunkRope(c.head_dim, c.rope_parameters)
        numel = c.chunk_size * c.num_kv_heads * c.head_dim
        self.num_outliers = min(round(c.outlier_fraction * numel), numel - 1)
        self.index_dtype = torch.int16 if numel <= torch.iinfo(torch.int16).max + 1 else torch.int32

    def layout(self, layer_id: int) -> Layout:
        c = self.config
        t, h, d, f16, n = c.chunk_size, c.num_kv_heads, c.head_dim, torch.float16, self.num_outliers
        codes = (t, h, d * self.bits // 8)
        specs = []
        for name, channels in (("k", (h, d)), ("v", (t, h))):  # keys: per channel; values: per token
            specs += [
                TensorSpec(f"{name}_codes", codes, torch.uint8),
                TensorSpec(f"{name}_scale", channels, f16),
                TensorSpec(f"{name}_zero", channels, f16),
                TensorSpec(f"{name}_levels", (self.num_levels,), f16),
                TensorSpec(f"{name}_out_val", (n,), c.dtype),
                TensorSpec(f"{name}_out_idx", (n,), self.index_dtype),
            ]
        specs.append(TensorSpec("pos", (t, h) if self.per_head_positions else (t,), torch.int32))
        return Layout(kind="quantized", chunk_size=t, rows=t, tensors=tuple(specs))

    # ------------------------------------------------------------------ compress

    def _positions(self, positions: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
        want = (*k.shape[:-1],) if self.per_head_positions else (*k.shape[:-2],)
        if positions is None or tuple(positions.shape) != want:
            got = None if positions is None else list(positions.shape)
            raise ValueError(f"{self.name}: compress() needs the chunk's positions {list(want)}, got {got}")
        return positions.to(k.device)

    def _rope_positions(self, pos: torch.Tensor) -> torch.Tensor:
        """Stored positions -> broadcastable to [..., T, H]."""
        return pos if self.per_head_positions else pos[..., None]

    def compress(self, layer_id, k, v, q=None, positions=None) -> CompressedChunk:
        self._check_kv(k, v)
        pos = self._positions(positions, k)
        k_pre = self.rope.unrotate(k.float(), self._rope_positions(pos))
        out = {}
        for name, x, dim in (("k", k_pre, -3), ("v", v.float(), -1)):
            codes, scale, zero, levels, out_val, out_idx = self.quantize(x, dim)
            out |= {
                f"{name}_codes": codes,
                f"{name}_scale": scale,
                f"{name}_zero": zero,
                f"{name}_levels": levels,
                f"{name}_out_val": out_val,
                f"{name}_out_idx": out_idx,
            }
        out["pos"] = pos.to(torch.int32)
        return CompressedChunk(out)

    def outliers(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """[..., N_o] ascending flat indices into x's [T, H, D] of its most outlying values."""
        med = x.median(dim=dim, keepdim=True).values
        dev = (x - med).abs()
        mad = dev.median(dim=dim, keepdim=True).values
        z = (dev / mad.clamp_min(torch.finfo(torch.float32).tiny)).flatten(-3)
        n = self.num_outliers
        if n == 0 or z.isnan().any():  # (NaN sorts above everything: the general path)
            order = torch.sort(z, dim=-1, descending=True, stable=True).indices
            return order[..., :n].sort(dim=-1).values
        # The n largest, ties at the n-th largest value broken towards the lower index (what a stable
        # descending sort keeps), in ascending order, without sorting the chunk: everything above the
        # threshold, then the first ties at it.
        thr = z.topk(n, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
        above = z > thr
        tie = z == thr
        need = n - above.sum(dim=-1, keepdim=True)
        keep = above | (tie & (tie.cumsum(dim=-1) <= need))
        return keep.nonzero()[:, -1].view(*z.shape[:-1], n)

    def quantize(self, x: torch.Tensor, dim: int):
        """x float32 [..., T, H, D], vectors along dim -> (packed codes, scale, zero, levels,
        outlier values, outlier indices)."""
        out_idx = self.outliers(x, dim)
        inlier = torch.ones_like(x, dtype=torch.bool).flatten(-3).scatter(-1, out_idx, False).view(x.shape)
        lo = torch.where(inlier, x, float("inf")).amin(dim=dim)
        hi = torch.where(inlier, x, float("-inf")).amax(dim=dim)
        empty = torch.isinf(lo)  # a vector made only of outliers: any range will do
        lo, hi = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
        zero = ((hi + lo) / 2).to(torch.float16)
        scale = f16_at_least(((hi - lo) / 2 + ((hi + lo) / 2 - zero.float()).abs()).clamp_min(F16_TINY))
        xn = (x - zero.float().unsqueeze(dim)) / scale.float().unsqueeze(dim)  # inliers in [-1, 1]
        num_in = x.shape[-3:].numel() - self.num_outliers
        fit = torch.where(inlier, xn, float("inf")).flatten(-3).sort(dim=-1).values[..., :num_in]
        levels = (
            kmeans_1d(fit, self.num_levels, self.config.kmeans_iters).to(torch.float16).sort(dim=-1).values
        )
        codes = nearest_level(xn.flatten(-3), levels).view(x.shape)
        out_val = x.flatten(-3).gather(-1, out_idx).to(self.config.dtype)
        return pack_bits(codes, self.bits), scale, zero, levels, out_val, out_idx.to(self.index_dtype)

    # ------------------------------------------------------------------ decompress

    def dequantize(self, chunk: CompressedChunk, name: str) -> torch.Tensor:
        """float32 [..., T, H, D] of tensor name ("k": pre-RoPE keys, "v": values), outliers exact."""
        c = self.config
        codes = unpack_bits(chunk[f"{name}_codes"], self.bits)  # [..., T, H, D] int32
        levels = chunk[f"{name}_levels"].float()  # [..., L]
        base = torch.arange(levels[..., 0].numel(), dtype=torch.int32, device=codes.device) * self.num_levels
        flat = codes.reshape(-1, codes.shape[-3:].numel()) + base[:, None]  # each chunk's own levels
        xn = levels.reshape(-1).index_select(0, flat.reshape(-1)).view(codes.shape)
        dim = -3 if name == "k" else -1
        x = xn * chunk[f"{name}_scale"].float().unsqueeze(dim) + chunk[f"{name}_zero"].float().unsqueeze(dim)
        flat = x.flatten(-3).scatter(-1, chunk[f"{name}_out_idx"].long(), chunk[f"{name}_out_val"].float())
        return flat.view(*x.shape[:-3], -1, c.num_kv_heads, c.head_dim)

    def decompress(self, layer_id, chunk):
        k_pre = self.dequantize(chunk, "k")
        k = self.rope.rotate(k_pre, self._rope_positions(chunk["pos"].long()))
        return k, self.dequantize(chunk, "v")


def kmeans_1d(sorted_x: torch.Tensor, k: int, iters: int) -> torch.Tensor:
    """Lloyd's k-means on each row of sorted_x [..., M] (ascending, finite) -> [..., k] centers,
    ascending. Start: the values at quantiles (i + 1/2) / k. In 1-D each cluster is a run of the
    sorted row, cut at the midpoints between centers (a value on a cut joins the upper cluster);
    its mean comes from float64 prefix sums. An empty cluster keeps its center. Row by row, so a
    batch gives each row's result bitwise."""
    m = sorted_x.shape[-1]
    dev = sorted_x.device
    start = ((torch.arange(k, device=dev, dtype=torch.float64) + 0.5) * m / k).long().clamp(max=m - 1)
    centers = sorted_x[..., start]
    csum = torch.nn.functional.pad(sorted_x.double().cumsum(dim=-1), (1, 0))  # [..., M + 1]
    lead = sorted_x.shape[:-1]
    first = torch.zeros((*lead, 1), dtype=torch.int64, device=dev)
    last = torch.full((*lead, 1), m, dtype=torch.int64, device=dev)
    sorted_c = sorted_x.contiguous()
    for _ in range(iters):
        cuts = torch.searchsorted(sorted_c, ((centers[..., 1:] + centers[..., :-1]) / 2).contiguous())
        starts, ends = torch.cat([first, cuts], dim=-1), torch.cat([cuts, last], dim=-1)
        count = ends - starts
        mean = (csum.gather(-1, ends) - csum.gather(-1, starts)) / count.clamp_min(1)
        centers = torch.where(count > 0, mean.float(), centers)
    return centers


def nearest_level(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """x [..., N], levels [..., L] ascending -> [..., N] int64 index of the nearest level (a value
    halfway between two levels takes the lower one)."""
    lv = levels.float()
    mid = ((lv[..., 1:] + lv[..., :-1]) / 2).contiguous()
    return torch.searchsorted(mid, x.contiguous(), right=False)
