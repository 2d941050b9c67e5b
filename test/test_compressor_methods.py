"""Issue 17's compressors, method by method on hand-made inputs: RoPE undone and redone, the Hadamard
transform, kvquant's levels and exact outliers, rotatekv, expected attention, KVzip's reconstruction
score and its proxy, and composition (drop, then quantize what is kept) with its name parser."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_vericache.compress import CompressorConfig, exact_bytes_per_token, get_compressor
from sglang_vericache.compress.kvquant import kmeans_1d, nearest_level
from sglang_vericache.compress.kvzip import ReconstructionPass, reconstruction_scores
from sglang_vericache.compress.quant import pack_bits, pack_codes, unpack_bits
from sglang_vericache.compress.rope import ChunkRope
from sglang_vericache.compress.rotatekv import fwht
from sglang_vericache.compressor_names import split_kv_compressor
from sglang_vericache.layers.rotary_embedding import RotaryEmbedding, apply_rotary_pos_emb
from sglang_vericache.server_args import ServerArgs

ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def make(name: str, **kw):
    args = (
        dict(
            ratio=4,
            chunk_size=16,
            num_layers=1,
            num_kv_heads=2,
            num_q_heads=4,
            head_dim=8,
            dtype=torch.float32,
        )
        | kw
    )
    return get_compressor(name, CompressorConfig(name, **args))


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- RoPE


def test_chunk_rope_is_the_models_rope_and_unrotate_inverts_it():
    rope, model = ChunkRope(8, ROPE), RotaryEmbedding(8, 64, ROPE)
    x, pos = randn(5, 3, 8), torch.tensor([0, 1, 7, 30, 63])
    cos, sin = model.get_cos_sin(pos, torch.float32)
    assert torch.equal(rope.rotate(x, pos[:, None]), apply_rotary_pos_emb(x, x, cos, sin)[0])
    torch.testing.assert_close(
        rope.unrotate(rope.rotate(x, pos[:, None]), pos[:, None]), x, atol=1e-6, rtol=0
    )


def test_rope_rotations_add():
    rope, x = ChunkRope(8, ROPE), randn(4, 8)
    pos = torch.arange(4)
    torch.testing.assert_close(
        rope.rotate(rope.rotate(x, pos), torch.tensor(5)), rope.rotate(x, pos + 5), atol=1e-6, rtol=0
    )


# ---------------------------------------------------------------- Hadamard (rotatekv)


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_fwht_is_sylvesters_hadamard_and_orthogonal():
    h = fwht(torch.eye(8)) * math.sqrt(8)  # rows of the transform of the identity
    torch.testing.assert_close(h, sylvester(8), atol=1e-6, rtol=0)
    signs = h.round()
    assert torch.equal(signs @ signs.T, 8 * torch.eye(8))
    assert torch.equal(fwht(torch.eye(16)) * 4, sylvester(16))  # 1/sqrt(16) is exact: bitwise


def test_fwht_round_trip_is_exact_on_a_dyadic_grid_and_close_otherwise():
    x = torch.randint(-8, 9, (3, 16)).float()  # sums of small integers, scaled by 1/4 twice: exact
    assert torch.equal(fwht(fwht(x)), x)
    y = randn(4, 128)
    torch.testing.assert_close(fwht(fwht(y)), y, atol=2e-6, rtol=0)


def test_rotatekv_spreads_an_outlier_channel_so_two_bits_lose_less():
    # values with one channel 30x the others: per-token 2-bit min-max wastes its range on it
    comp = make("rotatekv2", head_dim=64, group_size=64, num_kv_heads=1, num_q_heads=1)
    k, v = randn(16, 1, 64, seed=1), randn(16, 1, 64, seed=2)
    v[..., 5] *= 30
    _, vd = comp.decompress(0, comp.compress(0, k, v, positions=torch.arange(16)))
    plain = get_compressor(
        "kivi2", CompressorConfig("kivi2", 4, 16, 1, 1, 1, 64, dtype=torch.float32, group_size=64)
    )
    _, vp = plain.decompress(0, plain.compress(0, k, v))
    assert (vd - v).pow(2).mean() < 0.5 * (vp - v).pow(2).mean()


def test_rotatekv_error_is_within_half_a_step_in_the_rotated_basis():
    comp = make("rotatekv4", head_dim=16, group_size=8)
    k, v = randn(16, 2, 16, seed=3), randn(16, 2, 16, seed=4)
    pos = torch.arange(100, 116)
    chunk = comp.compress(0, k, v, positions=pos)
    kd, vd = comp.decompress(0, chunk)
    rotated = {"k": comp.rotate_keys(comp.rope.unrotate(k, pos[:, None])), "v": comp.rotate_values(v)}
    for name, x in rotated.items():
        step = chunk[f"{name}_scale"].float().repeat_interleave(8, dim=-1)  # groups of 8 rotated channels
        assert ((comp.dequantize(chunk, name) - x).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(chunk["pos"], pos.to(torch.int32))
    # back in the original basis (an orthogonal map keeps the L2 error), RoPE put back on the keys
    torch.testing.assert_close(kd, k, atol=0.3, rtol=0)
    torch.testing.assert_close(vd, v, atol=0.3, rtol=0)


def test_rotatekv_needs_positions():
    with pytest.raises(ValueError, match="positions"):
        make("rotatekv2").compress(0, randn(16, 2, 8), randn(16, 2, 8))


# ---------------------------------------------------------------- kvquant


def test_pack_bits_round_trips_and_agrees_with_pack_codes():
    codes = torch.randint(0, 8, (5, 16))
    packed = pack_bits(codes, 3)
    assert packed.shape == (5, 6) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, 3), codes)
    four = torch.randint(0, 16, (3, 8))
    assert torch.equal(pack_bits(four, 4), pack_codes(four, 4))
    # codes 1..7 then 0 in one 24-bit little-endian word: sum(c_k << 3k)
    word = sum(c << (3 * k) for k, c in enumerate([1, 2, 3, 4, 5, 6, 7, 0]))
    assert pack_bits(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]]), 3).tolist() == [
        [word & 255, word >> 8 & 255, word >> 16]
    ]


def test_kmeans_1d_finds_two_clusters_and_keeps_an_empty_cluster_center():
    x = torch.tensor([[0.0, 0, 0, 1, 1, 1, 10, 10]])
    assert kmeans_1d(x, 2, iters=5).tolist() == [[0.5, 10.0]]  # start at x[2] = 0 and x[6] = 10
    assert kmeans_1d(torch.zeros(1, 4), 3, iters=3).tolist() == [[0.0, 0.0, 0.0]]


def test_nearest_level_ties_go_to_the_lower_level():
    levels = torch.tensor([-1.0, 0.0, 0.5, 1.0])
    x = torch.tensor([-2.0, -0.5, -0.4, 0.25, 0.26, 0.75, 3.0])
    assert nearest_level(x, levels).tolist() == [0, 0, 1, 1, 2, 2, 3]


S3 = [-1.0, -0.75, -0.5, -0.25, 0.25, 0.5, 0.75, 1.0]  # 8 levels, float16-exact


def grid_chunk(seed: int) -> torch.Tensor:
    """[8, 2, 8]: each value vector (token, head) and each key channel (head, channel) over the 8
    tokens is a permutation of S3: a Latin square per head, rows and columns permuted."""
    g = torch.Generator().manual_seed(seed)
    s = torch.tensor(S3)
    out = torch.empty(8, 2, 8)
    for h in range(2):
        rows, cols = torch.randperm(8, generator=g), torch.randperm(8, generator=g)
        out[:, h] = s[(rows[:, None] + cols[None, :]) % 8]
    return out


def test_kvquant_levels_are_the_chunks_values_when_they_take_eight_values():
    comp = make("kvquant3", chunk_size=8, outlier_fraction=0.0)
    k, v = grid_chunk(0), grid_chunk(1)
    chunk = comp.compress(0, k, v, positions=torch.zeros(8, dtype=torch.int64))  # RoPE at 0 is the identity
    assert chunk["k_levels"].tolist() == S3 and chunk["v_levels"].tolist() == S3
    assert chunk["k_zero"].abs().max() == 0 and (chunk["k_scale"] == 1).all()  # every channel spans [-1, 1]
    kd, vd = comp.decompress(0, chunk)
    assert torch.equal(kd, k) and torch.equal(vd, v)


@pytest.mark.parametrize("seed", range(4))
def test_kvquant_outliers_are_a_stable_descending_sorts_first_n_in_index_order(seed):
    """outliers() selects by threshold (topk, then the first ties at the n-th largest score); it must be
    exactly the definition: a stable descending sort of the scores (ties: lower flat index first), its
    first N_o indices, ascending. Values on a coarse grid tie often, at the threshold too."""
    comp = make("kvquant4", chunk_size=16, head_dim=16, outlier_fraction=0.05)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, 16, 2, 16, generator=g) * 2).round() / 2
    x[1, :, 0] = 0.5  # a constant vector: MAD 0
    for dim in (-3, -1):
        med = x.median(dim=dim, keepdim=True).values
        dev = (x - med).abs()
        z = (dev / dev.median(dim=dim, keepdim=True).values.clamp_min(torch.finfo(torch.float32).tiny)).flatten(-3)
        want = torch.sort(z, dim=-1, descending=True, stable=True).indices[..., : comp.num_outliers].sort(-1).values
        assert torch.equal(comp.outliers(x, dim), want)


def test_kvquant_keeps_planted_outliers_exactly_and_they_do_not_widen_the_ranges():
    comp = make("kvquant4", chunk_size=16, head_dim=16, outlier_fraction=0.01)  # round(0.01 * 512) = 5
    assert comp.num_outliers == 5 and comp.index_dtype == torch.int16
    k, v = randn(16, 2, 16, seed=5), randn(16, 2, 16, seed=6)
    flat = [7, 100, 257, 300, 511]
    v.view(-1)[flat] = torch.tensor([40.0, -55.0, 61.5, 70.25, -33.0])
    pos = torch.arange(32, 48)
    k_pre = ChunkRope(16, ROPE).unrotate(k, pos[:, None])
    k_pre.view(-1)[flat] = torch.tensor([90.0, -80.0, 75.0, 66.0, -99.0])
    k = ChunkRope(16, ROPE).rotate(k_pre, pos[:, None])
    chunk = comp.compress(0, k, v, positions=pos)
    assert chunk["v_out_idx"].tolist() == flat and chunk["k_out_idx"].tolist() == flat
    _, vd = comp.decompress(0, chunk)
    assert torch.equal(vd.view(-1)[flat], v.view(-1)[flat])  # values: bitwise the exact tier's
    pre = ChunkRope(16, ROPE).unrotate(k, pos[:, None])  # what compress() quantizes
    assert torch.equal(comp.dequantize(chunk, "k").view(-1)[flat], pre.view(-1)[flat])
    assert chunk["v_scale"].float().max() < 5 and chunk["k_scale"].float().max() < 5  # outliers left out


def test_kvquant_quantizes_keys_before_rope():
    # pre-RoPE keys whose channels sit at different offsets: per channel they are narrow, but RoPE
    # at far positions mixes each channel pair, so per-channel ranges after RoPE are wide
    comp = make("kvquant4", chunk_size=16, head_dim=16, num_kv_heads=1, num_q_heads=1, outlier_fraction=0.0)
    pos = torch.arange(1000, 1016)
    k_pre = 0.1 * randn(16, 1, 16, seed=7) + torch.linspace(-8, 8, 16)
    k = ChunkRope(16, ROPE).rotate(k_pre, pos[:, None])
    kd, _ = comp.decompress(0, comp.compress(0, k, k, positions=pos))
    kivi = get_compressor(
        "kivi4", CompressorConfig("kivi4", 4, 16, 1, 1, 1, 16, dtype=torch.float32, group_size=16)
    )
    kk, _ = kivi.decompress(0, kivi.compress(0, k, k))
    assert (kd - k).pow(2).mean() < 0.1 * (kk - k).pow(2).mean()


def test_kvquant_needs_positions():
    with pytest.raises(ValueError, match="positions"):
        make("kvquant3").compress(0, randn(16, 2, 8), randn(16, 2, 8))


# ---------------------------------------------------------------- expected attention


def test_expected_attention_scores_on_a_two_token_chunk():
    # D = 2: one rotation pair at frequency 1 (RoPE at position p turns by p radians)
    comp = make(
        "expected_attention",
        ratio=2,
        chunk_size=2,
        num_kv_heads=1,
        num_q_heads=1,
        head_dim=2,
        num_sink_tokens=0,
        n_future_positions=1,
    )
    q_pre = torch.tensor([[[1.0, 0.0]], [[3.0, 0.0]]])  # mu = (2, 0), Sigma = [[1, 0], [0, 0]]
    q = ChunkRope(2, ROPE).rotate(q_pre, torch.tensor([[0], [1]]))
    k = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    v = torch.tensor([[[3.0, 4.0]], [[1.0, 0.0]]])  # norms 5, 1
    c, s = (
        math.cos(2),
        math.sin(2),
    )  # the only future position is 2: mu' = 2 (c, s), Sigma' = [[c^2, cs], [cs, s^2]]
    scale = 1 / math.sqrt(2)
    logits = [scale * 2 * c + 0.5 * scale**2 * c * c, scale * 2 * s + 0.5 * scale**2 * s * s]
    z = sum(math.exp(x) for x in logits)
    want = [math.exp(logits[0]) / z * 5, math.exp(logits[1]) / z * 1]
    got = comp.scores(q, k, v, torch.tensor([0, 1]))
    torch.testing.assert_close(got, torch.tensor([want]), atol=1e-6, rtol=0)
    kept = comp.compress(0, k, v, q=q, positions=torch.tensor([0, 1]))["idx"]
    assert kept.tolist() == [[int(want[1] > want[0])]]


def test_expected_attention_keeps_sinks_and_breaks_a_key_tie_by_value_norm():
    comp = make("expected_attention", ratio=4, num_sink_tokens=2)  # k = 4 of 16
    k, v, q = torch.zeros(16, 2, 8), torch.ones(16, 2, 8), randn(16, 4, 8, seed=8)
    v[9] *= 3  # every key draws the same attention, but token 9's value is 3x longer, 12's 2x,
    v[12] *= 2
    v[:2] *= 0.1  # and tokens 0, 1 the shortest: kept only where they are sinks
    assert comp.compress(0, k, v, q=q, positions=torch.arange(16))["idx"].t().tolist() == [[0, 1, 9, 12]] * 2
    later = comp.compress(0, k, v, q=q, positions=torch.arange(16, 32))["idx"].t().tolist()
    assert later == [[2, 3, 9, 12]] * 2  # the 1x ties go to the lower index


def test_expected_attention_leaves_the_sinks_out_of_the_softmax():
    """kvpress scores keys[n_sink:] (its softmax runs over them): the other keys' scores do not depend on
    the sinks' keys, and equal those of the same keys alone."""
    comp = make("expected_attention", ratio=4, num_sink_tokens=2)
    k, v, q = randn(16, 2, 8, seed=3), randn(16, 2, 8, seed=4), randn(16, 4, 8, seed=5)
    pos = torch.arange(16)
    base = comp.scores(q, k, v, pos)
    loud = k.clone()
    loud[:2] *= 50  # sinks that would take the whole softmax
    assert torch.equal(comp.scores(q, loud, v, pos), base)
    assert torch.isinf(base[:, :2]).all()
    alone = make("expected_attention", ratio=4, num_sink_tokens=0).scores(q[2:], k[2:], v[2:], pos[2:])
    torch.testing.assert_close(base[:, 2:], alone, atol=1e-6, rtol=1e-5)


def test_expected_attention_follows_the_mean_future_query():
    comp = make("expected_attention", ratio=8, num_kv_heads=1, num_q_heads=1, num_sink_tokens=0)  # k = 2
    pos = torch.arange(64, 80)
    rope = ChunkRope(8, ROPE)
    q_pre = torch.zeros(16, 1, 8)
    q_pre[..., 3] = 4.0  # every query points along pre-RoPE channel 3 (lowest frequencies turn least)
    k_pre = 0.1 * randn(16, 1, 8, seed=9)
    k_pre[[4, 10], 0, 3] = 3.0  # two keys along it
    kept = comp.compress(
        0,
        rope.rotate(k_pre, pos[:, None]),
        torch.ones(16, 1, 8),
        q=rope.rotate(q_pre, pos[:, None]),
        positions=pos,
    )["idx"]
    assert kept.t().tolist() == [[4, 10]]


# ---------------------------------------------------------------- KVzip


def test_reconstruction_score_is_the_max_softmax_over_chunk_and_own_causal_keys():
    # T = 2 chunk keys, R = 2 pass tokens, one head, D = 1: logits are products
    k = torch.tensor([[[1.0]], [[2.0]]])
    rec = ReconstructionPass(q=torch.tensor([[[1.0]], [[-1.0]]]), k=torch.tensor([[[3.0]], [[0.0]]]))
    # query 0 sees chunk keys (1, 2) and pass key 0 (3); query 1 sees (-1, -2) and pass keys (-3, 0)
    p0 = torch.softmax(torch.tensor([1.0, 2.0, 3.0]), 0)[:2]
    p1 = torch.softmax(torch.tensor([-1.0, -2.0, -3.0, 0.0]), 0)[:2]
    assert torch.equal(reconstruction_scores(rec, k, scale=1.0), torch.maximum(p0, p1)[None])


def test_reconstruction_score_takes_the_max_over_the_kv_groups_q_heads():
    k = torch.tensor([[[1.0]], [[0.0]]])
    rec = ReconstructionPass(
        q=torch.tensor([[[5.0], [-5.0]]]), k=torch.tensor([[[0.0]]])
    )  # 2 q-heads, 1 KV head
    p_up = torch.softmax(torch.tensor([5.0, 0.0, 0.0]), 0)[:2]
    p_down = torch.softmax(torch.tensor([-5.0, 0.0, 0.0]), 0)[:2]
    assert torch.equal(reconstruction_scores(rec, k, 1.0), torch.maximum(p_up, p_down)[None])


def test_reconstruction_score_counts_the_sinks_in_the_softmax_but_scores_only_the_chunk():
    k = torch.tensor([[[1.0]], [[2.0]]])
    rec = ReconstructionPass(q=torch.tensor([[[1.0]]]), k=torch.tensor([[[3.0]]]), sink_k=torch.tensor([[[4.0]]]))
    p = torch.softmax(torch.tensor([4.0, 1.0, 2.0, 3.0]), 0)[1:3]  # [sink | chunk | own]
    assert torch.equal(reconstruction_scores(rec, k, scale=1.0), p[None])


def test_kvzip_proxy_rereads_the_chunk_after_it_and_its_prompt():
    comp = make("kvzip_proxy", kvzip_prompt_tokens=3)
    assert comp.reconstruction_tokens() == 19 and comp.query_window(0) == 16
    assert not comp.needs_reconstruction and make("kvzip").needs_reconstruction
    assert make("kvzip").query_window(0) == 0
    q, k = randn(16, 4, 8, seed=10), randn(16, 2, 8, seed=11)
    rec = comp.proxy_pass(q, k)
    rope = ChunkRope(8, ROPE)
    assert torch.equal(rec.q, rope.rotate(q, torch.tensor(19))) and torch.equal(
        rec.k, rope.rotate(k, torch.tensor(19))
    )
    kept = comp.compress(0, k, randn(16, 2, 8), q=q, positions=torch.arange(16, 32))["idx"].t()
    from sglang_vericache.compress.token_drop import top_k_indices

    assert torch.equal(kept, top_k_indices(reconstruction_scores(rec, k, comp.config.scale), 4))


def test_kvzip_takes_the_schedulers_reconstruction_pass_and_keeps_sinks():
    comp = make("kvzip", num_kv_heads=1, num_q_heads=1, num_sink_tokens=2)  # k = 4 of 16
    k = 0.01 * randn(16, 1, 8, seed=12)
    k[[5, 11], 0, 0] = 4.0
    q_rep = torch.zeros(6, 1, 8)
    q_rep[:, 0, 0] = 3.0  # the pass's queries look for channel 0
    rec = ReconstructionPass(q_rep, torch.zeros(6, 1, 8))
    assert comp.compress(0, k, k, q=rec, positions=torch.arange(16))["idx"].t().tolist() == [[0, 1, 5, 11]]
    assert {5, 11} <= set(
        comp.compress(0, k, k, q=rec, positions=torch.arange(16, 32))["idx"].view(-1).tolist()
    )
    with pytest.raises(ValueError, match="ReconstructionPass"):
        comp.compress(0, k, k, q=ReconstructionPass(q_rep, torch.zeros(5, 1, 8)), positions=torch.arange(16))
    with pytest.raises(ValueError, match="needs the model runner's ReconstructionPass"):
        comp.compress(0, k, k, q=torch.zeros(16, 1, 8), positions=torch.arange(16))  # prefill queries: refused


# ---------------------------------------------------------------- composition


def shape(name: str, ratio: float = 4, **kw) -> CompressorConfig:
    args = (
        dict(chunk_size=64, num_layers=4, num_kv_heads=2, num_q_heads=4, head_dim=64, dtype=torch.bfloat16)
        | kw
    )
    return CompressorConfig(name, ratio, **args)


def test_composed_layout_is_the_quantizer_over_the_kept_rows():
    # snapkv at R = 4 keeps 16 of 64 rows; kivi4 of 16 rows: codes 2 * 16 * 2 * 64 / 2 = 2048 B,
    # key scale+zero [1, 2, 64] x 2 x 2 B = 512, value scale+zero [16, 2, 2] x 2 x 2 B = 256:
    # 2816 B per 64 tokens
    comp = get_compressor("snapkv+kivi4", shape("snapkv+kivi4"))
    layout = comp.layout(0)
    assert (layout.kind, layout.chunk_size, layout.rows) == ("quantized", 64, 16)
    assert {s.name for s in layout.tensors} == {"k", "k_scale", "k_zero", "v", "v_scale", "v_zero"}
    assert layout.bytes_per_token() == 2816 / 64 == 44.0
    assert comp.effective_ratio() == pytest.approx(
        512 / 44
    )  # 11.6x: snapkv's 4x times kivi4's 2.9x at 16 rows


@pytest.mark.parametrize(
    "spec, lo, hi",
    [("snapkv+kivi4", 8, 16), ("snapkv+kivi2", 12, 24), ("kvzip+kvquant3", 8, 24), ("h2o+int8", 6, 8)],
)
def test_compositions_reach_the_product_of_their_ratios(spec, lo, hi):
    assert lo <= get_compressor(spec, shape(spec)).effective_ratio() <= hi


def test_composed_chunk_is_the_quantizer_applied_to_the_droppers_kept_rows():
    cfg = shape("snapkv+kivi4", dtype=torch.float32)
    comp = get_compressor("snapkv+kivi4", cfg)
    k, v, q = randn(64, 2, 64, seed=13), randn(64, 2, 64, seed=14), randn(8, 4, 64, seed=15)
    chunk = comp.compress(1, k, v, q=q, positions=torch.arange(64))
    snap = get_compressor("snapkv", shape("snapkv", dtype=torch.float32))
    kept = snap.compress(1, k, v, q=q, positions=torch.arange(64))
    kivi = get_compressor("kivi4", shape("kivi4", chunk_size=16, dtype=torch.float32))
    want = kivi.compress(1, kept["k"], kept["v"])
    assert all(torch.equal(chunk[n], t) for n, t in want.tensors.items())
    assert all(torch.equal(a, b) for a, b in zip(comp.decompress(1, chunk), kivi.decompress(1, want)))


def test_composed_pre_rope_quantizer_gets_each_kept_rows_own_position():
    comp = get_compressor("knorm+kvquant4", shape("knorm+kvquant4", dtype=torch.float32))
    k, v = randn(64, 2, 64, seed=16), randn(64, 2, 64, seed=17)
    pos = torch.arange(640, 704)
    chunk = comp.compress(0, k, v, positions=pos)
    idx = (
        get_compressor("knorm", shape("knorm", dtype=torch.float32)).compress(0, k, v)["idx"].long()
    )  # [16, 2]
    assert torch.equal(chunk["pos"], (640 + idx).to(torch.int32))
    kd, _ = comp.decompress(0, chunk)
    rows = torch.gather(k, 0, idx[..., None].expand(16, 2, 64))
    assert (kd - rows).abs().mean() < 0.1  # 4-bit error on the kept rows, RoPE put back at their positions


def test_kivi_key_groups_tile_kept_rows_that_are_not_a_multiple_of_the_group():
    comp = get_compressor("snapkv+kivi2", shape("snapkv+kivi2", ratio=1.59))  # 40 rows, G = 32 -> groups of 8
    assert comp.layout(0).rows == 40 and comp.stage(0).key_group == 8


@pytest.mark.parametrize(
    "spec, message",
    [
        ("snapkv+nope", "unknown part 'nope'"),
        ("snapkv+", "unknown part ''"),
        ("kivi4+snapkv", "one token-dropping compressor .* then one quantizer"),
        ("snapkv+h2o", "then one quantizer"),
        ("snapkv+kivi4+int8", "a composition is one token-dropping"),
        ("zip", "must be one of streamingllm"),
    ],
)
def test_bad_compositions_are_refused_naming_the_part(spec, message):
    for build in (
        split_kv_compressor,
        lambda s: get_compressor(s, shape(s)),
        lambda s: ServerArgs(kv_compressor=s),
    ):
        with pytest.raises(ValueError, match=message):
            build(spec)


def test_composition_names_split_and_every_part_is_registered():
    assert split_kv_compressor("snapkv+kivi4") == ("snapkv", "kivi4")
    assert split_kv_compressor("kvquant3") == ("kvquant3",)
    assert ServerArgs(kv_compressor="pyramidkv+rotatekv2").kv_mode == "lossy"


def test_exact_bytes_reference():
    assert exact_bytes_per_token(shape("int8")) == 512
