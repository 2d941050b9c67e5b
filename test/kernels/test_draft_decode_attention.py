"""sgl_kernel_ext.cpu_draft_attention: the fused CPU draft-decode kernel over compressed KV read in place.

Every compressor's layout, float32, bfloat16 and float16: the kernel equals float64 softmax attention over the
torch reference context (compressor.decompress rows | exact tail | draft rows) to float32 rounding,
with odd lengths, empty tails, no drafts and single chunks; a request's output is bitwise the same
whatever else is in the batch, wherever it sits, however its index rows are padded, with any thread
count. Unused pool rows are NaN, so a kernel reading past a request's keys fails.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from sgl_kernel_ext.cpu_draft_attention import (
    compressed_layer,
    draft_decode_attention,
    draft_decode_attention_ref,
)

from sglang_vericache.compress import CompressorConfig, get_compressor
from sglang_vericache.compress.registry import COMPRESSOR_NAMES, fp8_supported
from sglang_vericache.mem_cache.compressed_pool import CompressedKVPool
from sglang_vericache.testing.draft_batches import random_scoring_input

T, HKV, G, D = 16, 2, 4, 64
SCALE = D**-0.5
# Every layout: token drop, int8, fp8, kivi, kvquant (non-uniform levels, exact outliers, pre-RoPE keys),
# rotatekv (Hadamard basis over both KV heads, pre-RoPE keys), and drop+those (per-head positions).
PRE_ROPE = ("kvquant3", "kvquant4", "rotatekv2", "rotatekv4")
SAME_LAYOUT_AS_KVZIP = ("kvzip_proxy", "kvzap")  # kvzip's layout, other scorers: nothing new for the kernel
NAMES = [n for n in COMPRESSOR_NAMES + ("snapkv+kivi4", "pyramidkv+int8", "snapkv+kvquant3", "pyramidkv+rotatekv4")
         if (n != "fp8" or fp8_supported()) and n not in SAME_LAYOUT_AS_KVZIP]
# (compressed chunks, tail rows, draft rows) per request (token drop keeps 5 rows of 16 per chunk):
# odd totals across 64-key chunk edges,
# an empty tail, one chunk, no chunk, no drafts
MIX = [(5, 7, 3), (1, 0, 1), (0, 13, 2), (9, 1, 0), (3, 15, 5)]


def rows(n: int, dtype, gen, head_dim: int = D) -> torch.Tensor:
    return torch.randn(n, HKV, head_dim, generator=gen).to(dtype)


def nan_pool(n: int, dtype, head_dim: int = D) -> torch.Tensor:
    pool = torch.full((n, HKV, head_dim), float("nan"), dtype=dtype)
    pool[0] = 0  # slot 0: the padding slot, finite
    return pool


def kernel_layer(comp, pool, lid: int = 0):
    """compressed_layer of the pool's layer, with what a pre-RoPE quantizer needs (as draft_kernel passes it)."""
    quant = comp.stage(lid) if hasattr(comp, "stage") else comp
    extra = ()
    if hasattr(quant, "dequantize"):  # kvquant / rotatekv: the compressor's own RoPE table
        rotation = (quant.key_heads, quant.block) if hasattr(quant, "key_heads") else None
        extra = (quant.rope.table(torch.tensor([1024])), rotation)
    return compressed_layer(pool.layouts[lid].kind, pool.buffers[lid], *extra)


class Case:
    """A compressed pool (one layer) and exact / draft pools holding MIX's requests under shuffled ids."""

    def __init__(self, name: str, dtype: torch.dtype, mix=MIX, seed: int = 0, group_size: int = 8, chunk: int = T,
                 head_dim: int = D, position_gap: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.scale = head_dim**-0.5
        cfg = CompressorConfig(name, ratio=3, chunk_size=chunk, num_layers=1, num_kv_heads=HKV, num_q_heads=HKV * G,
                               head_dim=head_dim, dtype=dtype, group_size=group_size)
        self.comp = get_compressor(name, cfg)
        n_chunks = sum(c for c, _, _ in mix)
        self.pool = CompressedKVPool(self.comp, num_layers=1, num_chunks=n_chunks + 3)
        for buf in self.pool.buffers[0].values():  # unused chunks: NaN rows / NaN scales
            if buf.is_floating_point() and buf.element_size() > 1:
                buf.fill_(float("nan"))
        n_tail, n_draft = sum(t for _, t, _ in mix), sum(d for _, _, d in mix)
        self.tail_k, self.tail_v = nan_pool(n_tail + 5, dtype, head_dim), nan_pool(n_tail + 5, dtype, head_dim)
        self.draft_k, self.draft_v = nan_pool(n_draft + 4, dtype, head_dim), nan_pool(n_draft + 4, dtype, head_dim)
        ids = (torch.randperm(n_chunks + 3, generator=gen)[:n_chunks] + 1).tolist()
        tail_slots = (torch.randperm(n_tail + 4, generator=gen)[:n_tail] + 1).tolist()
        draft_slots = (torch.randperm(n_draft + 3, generator=gen)[:n_draft] + 1).tolist()
        self.reqs = []  # per request: (chunk ids, tail slots, draft slots)
        for c, t, d in mix:
            mine = [ids.pop() for _ in range(c)], [tail_slots.pop() for _ in range(t)], [draft_slots.pop() for _ in range(d)]
            if c:
                k = rows(c * chunk, dtype, gen, head_dim).unflatten(0, (c, chunk))
                v = rows(c * chunk, dtype, gen, head_dim).unflatten(0, (c, chunk))
                qw = random_scoring_input(self.comp, 0, (c,), gen, dtype)
                pos = torch.arange(c * chunk).view(c, chunk)
                pos[:, chunk // 2 :] += position_gap  # a gap inside every chunk
                self.pool.write(0, torch.tensor(mine[0]), self.comp.compress(0, k, v, q=qw, positions=pos))
            for slots, kp, vp in ((mine[1], self.tail_k, self.tail_v), (mine[2], self.draft_k, self.draft_v)):
                kp[slots], vp[slots] = rows(len(slots), dtype, gen, head_dim), rows(len(slots), dtype, gen, head_dim)
            self.reqs.append(mine)
        self.q = torch.randn(len(mix), HKV * G, head_dim, generator=gen).to(dtype)

    def run(self, order: list[int] | None = None, pad: int = 0, round_to=None, layer=None) -> torch.Tensor:
        """The kernel over requests `order` (default all), index rows padded by `pad` extra columns,
        dequantized rows rounded to round_to (default: q's dtype, as the torch backend passes), reading
        `layer` (default kernel_layer's)."""
        round_to = self.q.dtype if round_to is None else round_to
        order = list(range(len(self.reqs))) if order is None else order

        def table(lists):
            width = max(len(x) for x in lists) + pad
            t = torch.zeros(len(lists), width, dtype=torch.int64)
            for i, x in enumerate(lists):
                t[i, : len(x)] = torch.tensor(x, dtype=torch.int64)
            return t, torch.tensor([len(x) for x in lists])

        chunks, tails, drafts = (table([self.reqs[i][p] for i in order]) for p in range(3))
        layer = kernel_layer(self.comp, self.pool) if layer is None else layer
        return draft_decode_attention(self.q[order], layer, *chunks, (self.tail_k, self.tail_v, *tails),
                                      (self.draft_k, self.draft_v, *drafts), self.scale, round_to)

    def reference(self, round_to=None) -> torch.Tensor:
        """Softmax attention over [decompress() rows in round_to (default q's dtype) | tail | drafts]."""
        round_to = self.q.dtype if round_to is None else round_to
        keys, values = [], []
        for ids, tail, draft in self.reqs:
            k, v = self.pool.decompress(0, torch.tensor(ids, dtype=torch.int64))  # float32 rows
            k, v = k.to(round_to).float(), v.to(round_to).float()
            keys.append(torch.cat([k, self.tail_k[tail].float(), self.draft_k[draft].float()]))
            values.append(torch.cat([v, self.tail_v[tail].float(), self.draft_v[draft].float()]))
        return draft_decode_attention_ref(self.q.float(), keys, values, self.scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", NAMES)
def test_matches_attention_over_the_torch_reference_context(name, dtype):
    case = Case(name, dtype)
    out = case.run()
    assert out.dtype == torch.float32 and out.shape == (len(MIX), HKV * G, D)
    assert (out - case.reference()).abs().max().item() < 2e-6


@pytest.mark.parametrize("name", ["int8", "kivi4", "fp8"])
def test_dequantized_rows_are_read_in_float32_or_rounded_as_asked(name):
    """bf16 pools and queries: float32 rows unless round_to says bf16 / fp16; the two differ."""
    if name == "fp8" and not fp8_supported():
        pytest.skip("no torch.float8_e4m3fn")
    case = Case(name, torch.bfloat16, seed=2)
    outs = {}
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        outs[dt] = case.run(round_to=dt)
        assert (outs[dt] - case.reference(round_to=dt)).abs().max().item() < 2e-6
    assert not torch.equal(outs[torch.float32], outs[torch.bfloat16])
    assert not torch.equal(outs[torch.bfloat16], outs[torch.float16])


@pytest.mark.parametrize("name", ["streamingllm", "int8", "kivi2", "kivi4", "fp8"])
def test_one_request_one_chunk_and_no_tail_or_draft(name):
    if name == "fp8" and not fp8_supported():
        pytest.skip("no torch.float8_e4m3fn")
    case = Case(name, torch.float32, mix=[(1, 0, 0)], seed=3)
    assert (case.run() - case.reference()).abs().max().item() < 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group_size", [4, 8, 32])
@pytest.mark.parametrize("name", ["int8", "fp8", "kivi2", "kivi4", "kvquant3", "rotatekv2", "rotatekv4"])
def test_a_single_key_returns_its_dequantized_value_row_bitwise(name, group_size, dtype):
    """Chunks of one token: each request's only key is one dequantized row, and softmax over one key
    is exactly 1, so the output is that row: the kernel dequantizes exactly as decompress(), and in
    bfloat16 rounds the row exactly as decompress().to(bfloat16) does."""
    if name == "fp8" and not fp8_supported():
        pytest.skip("no torch.float8_e4m3fn")
    case = Case(name, dtype, mix=[(1, 0, 0)] * 6, seed=5, group_size=group_size, chunk=1)
    ids = torch.tensor([r[0][0] for r in case.reqs])
    _, v = case.pool.decompress(0, ids)  # [6, Hkv, D], one row per chunk
    assert torch.equal(case.run(), v.to(dtype).float().repeat_interleave(G, dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group_size", [16, 32])
@pytest.mark.parametrize("name", PRE_ROPE)
def test_pre_rope_rows_of_the_common_head_dims(name, group_size, head_dim, dtype):
    """Head dims 64 and 128 with scale groups of whole 16-lane vectors: under AVX-512 kvquant's and rotatekv's
    rows are dequantized, transformed and rotated in registers (kvquant_rows_fused / rotatekv_rows_fused;
    elsewhere the general loops). The attention as the reference's, and every value row of one-key
    requests bitwise as decompress().to(dtype)."""
    case = Case(name, dtype, seed=8, group_size=group_size, head_dim=head_dim)
    assert (case.run() - case.reference()).abs().max().item() < 2e-6
    one = Case(name, dtype, mix=[(1, 0, 0)] * 6, seed=9, group_size=group_size, chunk=1, head_dim=head_dim)
    _, v = one.pool.decompress(0, torch.tensor([r[0][0] for r in one.reqs]))
    assert torch.equal(one.run(), v.to(dtype).float().repeat_interleave(G, dim=1))


# Where AVX-512 dequantizes 16 values at a time, what is left goes through the 8-lane code: rows of 40
# (32 + 8; RoPE halves of 20: the scalar rotation) and 48 (RoPE halves of 24: 16 + 8).
ODD_DIMS = [40, 48]
ODD_DIM_NAMES = ["int8", "fp8", "kivi2", "kivi4", "kvquant3", "kvquant4", "rotatekv2", "snapkv"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_dim", ODD_DIMS)
@pytest.mark.parametrize("name", ODD_DIM_NAMES)
def test_head_dims_past_the_16_lane_loops(name, head_dim, dtype):
    """Every value row of one-key requests bitwise as decompress().to(dtype), and the attention over
    MIX's contexts as the reference's."""
    if name == "fp8" and not fp8_supported():
        pytest.skip("no torch.float8_e4m3fn")
    case = Case(name, dtype, seed=6, head_dim=head_dim)
    assert (case.run() - case.reference()).abs().max().item() < 2e-6
    if name == "snapkv":  # token drop: rows are read exactly (no single-token chunks)
        return
    one = Case(name, dtype, mix=[(1, 0, 0)] * 6, seed=7, chunk=1, head_dim=head_dim)
    _, v = one.pool.decompress(0, torch.tensor([r[0][0] for r in one.reqs]))
    assert torch.equal(one.run(), v.to(dtype).float().repeat_interleave(G, dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [24, 100])
@pytest.mark.parametrize("name", ["kvquant3", "kvquant4"])
def test_kvquant_chunks_split_between_64_key_windows(name, chunk, dtype):
    """Chunks of 24 and 100 rows: the kernel's 64-key windows take a chunk's rows in two or more pieces, whose
    outlier lists are read on from where the piece before stopped; float32 and rounded rows."""
    case = Case(name, dtype, mix=[(3, 5, 2), (1, 0, 1), (4, 11, 0)], seed=8, chunk=chunk)
    for round_to in (torch.float32, dtype):
        out = case.run(round_to=round_to)
        assert (out - case.reference(round_to=round_to)).abs().max().item() < 2e-6
        assert torch.equal(case.run([2], round_to=round_to)[0], out[2])


@pytest.mark.parametrize("num_kv_heads", [1, 3])
@pytest.mark.parametrize("name", ["kvquant3", "snapkv+kvquant3"])
def test_kvquant_kv_head_counts_one_and_not_a_power_of_two(name, num_kv_heads, monkeypatch):
    """One KV head (every outlier this head's) and three (a row-head index split by table, not by shifts)."""
    monkeypatch.setattr(sys.modules[__name__], "HKV", num_kv_heads)
    case = Case(name, torch.float32, mix=[(3, 5, 2), (1, 0, 1), (4, 11, 0)], seed=9, chunk=24)
    out = case.run()
    assert out.shape == (3, num_kv_heads * G, D)
    assert (out - case.reference()).abs().max().item() < 2e-6
    assert torch.equal(case.run([1, 2])[1], out[2])


@pytest.mark.parametrize("heads_per_kv_head", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [16, 32, 48])
@pytest.mark.parametrize("num_kv_heads", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", PRE_ROPE + ("kivi2", "kivi4"))
def test_keys_scored_from_their_codes(name, head_dim, num_kv_heads, chunk, heads_per_kv_head, monkeypatch):
    """Float32 rows (what the model passes), chunks of a multiple of 16 rows at consecutive positions: under AVX-512
    kvquant's, rotatekv's and kivi's keys are scored 16 at a time from their codes and the values summed from theirs
    (kvquant_key_scores / rotatekv_key_scores / kivi_key_scores; chunks of 48 are split between 64-key windows, and
    hold three kivi key groups of 16), rotatekv where its Hadamard transform spans at most 128
    channels (one or two heads of 64, one of 128), rotatekv and kivi where a KV head has 1, 2 or 4 query heads; the
    rest (3 query heads, rotatekv over two heads of 128) take the row path. Queries in bfloat16 as the model's. The
    attention as the reference's, a request's output bitwise the same alone, and with every chunk's positions
    broken by a gap (pre-RoPE keys: the row path) the reference's again."""
    monkeypatch.setattr(sys.modules[__name__], "G", heads_per_kv_head)
    monkeypatch.setattr(sys.modules[__name__], "HKV", num_kv_heads)
    mix = [(3, 5, 2), (1, 0, 1), (4, 11, 0), (2, 0, 0)]
    # kivi: chunks of whole groups of 32 or 16 (its 4-bit values in groups of 16: the row path)
    group = 16 if name.startswith("kivi") and chunk % 32 else 32
    for gap in (0, 3):
        case = Case(name, torch.bfloat16, mix=mix, seed=11, chunk=chunk, head_dim=head_dim, group_size=group,
                    position_gap=gap)
        out = case.run(round_to=torch.float32)
        assert (out - case.reference(round_to=torch.float32)).abs().max().item() < 2e-6
        assert torch.equal(case.run([2], round_to=torch.float32)[0], out[2])


@pytest.mark.parametrize("group_size", [4, 16, 32])
@pytest.mark.parametrize("name", ["kivi2", "kivi4"])
def test_kivi_groups_narrower_and_wider_than_a_vector(name, group_size):
    """Value groups of 4 channels (scales expanded per channel) and of 16 / 32; key groups of 4-16 tokens."""
    case = Case(name, torch.float32, seed=4, group_size=group_size)
    assert (case.run() - case.reference()).abs().max().item() < 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["pyramidkv", "kivi4", "int8", "kvquant4", "rotatekv2", "snapkv+kvquant3"])
def test_a_request_is_bitwise_the_same_alone_among_others_padded_and_on_one_thread(name, dtype):
    case = Case(name, dtype, seed=1)
    batch = case.run()
    for b in range(len(MIX)):
        assert torch.equal(case.run([b])[0], batch[b])
        assert torch.equal(case.run([b], pad=7)[0], batch[b])
    assert torch.equal(case.run([4, 2, 0, 3, 1])[[2, 4, 1, 3, 0]], batch)
    assert torch.equal(case.run([3, 3, 3])[1], batch[3])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(case.run(), batch)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("round_to", [torch.float32, torch.bfloat16], ids=["fp32_rows", "bf16_rows"])
@pytest.mark.parametrize("name", PRE_ROPE)
def test_a_rope_table_is_read_by_its_first_half_where_pairs_share_an_angle(name, round_to):
    """ChunkRope's table (cat(freqs, freqs)) reaches the kernel as its first half [P, D/2] and that half
    pair-major [D/2, P]; the whole table [P, D] in the first's place gives the same output bitwise (float32 rows:
    the key-score paths read the pair-major table; rounded rows: the row path the first); a table whose halves
    differ is passed whole, with no pair-major copy."""
    case = Case(name, torch.float32, seed=10, group_size=32)
    half = kernel_layer(case.comp, case.pool)
    cos, sin = case.comp.rope.table(torch.tensor([1024]))
    *_, c, s, c_t, s_t = half.tensors
    assert c.shape == (cos.shape[0], D // 2) and torch.equal(c, cos[:, : D // 2]) and torch.equal(s, sin[:, : D // 2])
    assert torch.equal(c_t[:, : len(c)], c.t()) and torch.equal(s_t[:, : len(s)], s.t()) and c_t.is_contiguous()
    whole = dataclasses.replace(half, tensors=(*half.tensors[:-4], cos, sin, c_t, s_t))
    assert torch.equal(case.run(layer=whole, round_to=round_to), case.run(layer=half, round_to=round_to))
    other = cos.clone()
    other[:, D // 2 :] += 1.0
    rotation = (case.comp.key_heads, case.comp.block) if hasattr(case.comp, "key_heads") else None
    apart = compressed_layer(case.pool.layouts[0].kind, case.pool.buffers[0], (other, sin), rotation)
    assert apart.tensors[-4].shape == cos.shape and apart.tensors[-2].numel() == 0
    assert not torch.equal(case.run(layer=apart, round_to=round_to), case.run(layer=half, round_to=round_to))


def test_unknown_layouts_are_not_claimed_and_bad_inputs_are_refused():
    assert compressed_layer("quantized", {"k": torch.zeros(1, dtype=torch.uint8), "codebook": torch.zeros(1)}) is None
    for name in PRE_ROPE:  # not without the compressor's RoPE table (nor read as kivi's codes)
        assert compressed_layer("quantized", Case(name, torch.float32, mix=[(1, 0, 1)]).pool.buffers[0]) is None
    assert compressed_layer("product_quantized", {"k": torch.zeros(1), "v": torch.zeros(1)}) is None
    case = Case("int8", torch.float32, mix=[(1, 2, 1)])
    ids, tail, draft = case.reqs[0]
    layer = compressed_layer("quantized", case.pool.buffers[0])
    one = torch.tensor([1])
    args = (torch.tensor([ids]), one, (case.tail_k, case.tail_v, torch.tensor([tail]), torch.tensor([2])))
    draft_part = (case.draft_k, case.draft_v, torch.tensor([draft]), one)
    with pytest.raises(RuntimeError, match="lens"):
        draft_decode_attention(case.q, layer, *args[:2], (*args[2][:3], torch.tensor([3])), draft_part, SCALE)
    with pytest.raises(RuntimeError, match="chunk id out of range"):
        draft_decode_attention(case.q, layer, torch.tensor([[99]]), one, args[2], draft_part, SCALE)
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        draft_decode_attention(case.q[:, :3], layer, *args, draft_part, SCALE)
