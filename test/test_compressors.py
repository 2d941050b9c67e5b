"""Compressor library: kept sets, quantization error bounds, static layouts, bytes per token."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from sglang_vericache.compress import (
    COMPRESSOR_NAMES,
    CompressorConfig,
    exact_bytes_per_token,
    get_compressor,
)
from sglang_vericache.compress.pyramidkv import pyramid_budgets
from sglang_vericache.model_config import ModelConfig
from sglang_vericache.compress.quant import f16_at_least, f16_at_most, pack_codes, unpack_codes
from sglang_vericache.compress.token_drop import attention_mass

TOKEN_DROP = ("streamingllm", "snapkv", "pyramidkv", "h2o", "knorm", "expected_attention", "kvzip", "kvzip_proxy",
              "kvzap")
QUANTIZERS = ("kivi2", "kivi4", "int8", "fp8", "kvquant3", "kvquant4", "rotatekv2", "rotatekv4")


def chunk_queries(comp, layer, lead=(), num_q=4, d=64, dtype=torch.bfloat16, g=None):
    """What compress() takes as q: trailing queries, kvzip's ReconstructionPass (R = 5, 2 sinks), or None."""
    from sglang_vericache.compress.kvzip import ReconstructionPass

    h_kv = comp.config.num_kv_heads
    rand = lambda *shape: torch.randn(*lead, *shape, generator=g).to(dtype)  # noqa: E731
    if comp.needs_reconstruction:
        return ReconstructionPass(rand(5, num_q, d), rand(5, h_kv, d), rand(2, h_kv, d))
    if getattr(comp, "reads_hidden", False):  # kvzap: the chunk's hidden states
        return rand(comp.config.chunk_size, comp.surrogate.hidden_size)
    window = comp.query_window(layer)
    return torch.randn(*lead, window, num_q, d, generator=g).to(dtype) if window else None


def random_surrogate(num_layers: int, hidden: int = 32, heads: int = 2) -> str:
    """A random linear KVzap surrogate's file (kvzap scores hidden states with it), written once per shape."""
    import os
    import tempfile

    from sglang_vericache.compress.kvzap import KVzapSurrogate

    path = os.path.join(tempfile.gettempdir(), f"vericache-test-kvzap-{os.getpid()}-{num_layers}x{hidden}x{heads}.st")
    if not os.path.exists(path):
        g = torch.Generator().manual_seed(num_layers)
        KVzapSurrogate({"w": torch.randn(num_layers, hidden, heads, generator=g), "b": torch.zeros(num_layers, heads)}
                       ).save(path)
    return path


def make(name: str, **kw):
    args = dict(ratio=4, chunk_size=16, num_layers=1, num_kv_heads=2, num_q_heads=4, head_dim=4)
    args.update({"dtype": torch.float32} | kw)
    if name == "kvzap":
        args["kvzap_path"] = random_surrogate(args["num_layers"], heads=args["num_kv_heads"])
    return get_compressor(name, CompressorConfig(name, **args))


def kept(chunk) -> list[list[int]]:
    """Per KV head, the chunk-relative indices the chunk stores."""
    return chunk["idx"].t().tolist()


def random_kv(t=16, h=2, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, d, generator=g), torch.randn(t, h, d, generator=g)


def assert_rows_are(comp, chunk, k, v, expected: list[list[int]]):
    kd, vd = comp.decompress(0, chunk)
    for h, rows in enumerate(expected):
        assert torch.equal(kd[:, h], k[rows, h].float()) and torch.equal(vd[:, h], v[rows, h].float())


# ---------------------------------------------------------------- StreamingLLM


def test_streamingllm_first_chunk_keeps_sinks_and_recent():
    comp = make("streamingllm", ratio=2)  # k = 8: sinks 0..3 + the 4 most recent
    k, v = random_kv()
    chunk = comp.compress(0, k, v, positions=torch.arange(16))
    assert kept(chunk) == [[0, 1, 2, 3, 12, 13, 14, 15]] * 2
    assert_rows_are(comp, chunk, k, v, kept(chunk))


def test_streamingllm_later_chunk_keeps_only_recent():
    comp = make("streamingllm")  # k = 4
    k, v = random_kv()
    chunk = comp.compress(0, k, v, positions=torch.arange(16, 32))
    assert kept(chunk) == [[12, 13, 14, 15]] * 2
    assert_rows_are(comp, chunk, k, v, kept(chunk))


def test_streamingllm_more_sinks_than_budget_keeps_first_sinks():
    comp = make("streamingllm", num_sink_tokens=8)  # k = 4 < 8 sinks
    k, v = random_kv()
    assert kept(comp.compress(0, k, v, positions=torch.arange(16))) == [[0, 1, 2, 3]] * 2


def test_streamingllm_needs_positions():
    k, v = random_kv()
    with pytest.raises(ValueError, match="positions"):
        make("streamingllm").compress(0, k, v)


# ---------------------------------------------------------------- SnapKV / attention mass


def test_attention_mass_is_causal_and_summed_over_queries_and_group():
    # zero queries -> uniform attention over the visible keys; window query i sits at 12 + i
    q, k = torch.zeros(4, 4, 4), torch.randn(16, 2, 4)
    mass = attention_mass(q, k, scale=0.5)
    expected = [2 * sum(1 / (13 + i) for i in range(4) if j <= 12 + i) for j in range(16)]
    assert torch.allclose(mass, torch.tensor([expected, expected]), rtol=1e-6, atol=0)


def snapkv_chunk(aligned: dict[int, dict[int, float]]):
    """Keys are zero except aligned[h][token] * e_h; q-heads of KV group h all point along e_h."""
    k, v = torch.zeros(16, 2, 4), torch.randn(16, 2, 4)
    for h, tokens in aligned.items():
        for t, mag in tokens.items():
            k[t, h, h] = mag
    q = torch.zeros(4, 4, 4)
    q[:, 0:2, 0] = 1.0  # q-heads 0, 1 -> KV head 0
    q[:, 2:4, 1] = 1.0  # q-heads 2, 3 -> KV head 1
    return k, v, q


def test_snapkv_keeps_window_and_top_scored_keys_per_head():
    comp = make("snapkv", ratio=2, window_size=4, kernel_size=1)  # k = 8: window 12..15 + top 4
    assert comp.query_window(0) == 4
    k, v, q = snapkv_chunk({0: {1: 10, 5: 9, 7: 8, 10: 7, 2: 1}, 1: {0: 10, 3: 9, 8: 8, 11: 7, 4: 1}})
    chunk = comp.compress(0, k, v, q=q)
    expected = [[1, 5, 7, 10, 12, 13, 14, 15], [0, 3, 8, 11, 12, 13, 14, 15]]
    assert kept(chunk) == expected
    assert_rows_are(comp, chunk, k, v, expected)


def test_snapkv_avg_pooling_keeps_neighbours_of_a_strong_key():
    comp = make("snapkv", ratio=2.2, window_size=4, kernel_size=3)  # k = floor(16 / 2.2) = 7: window + 3
    k, v, q = snapkv_chunk({0: {5: 10}, 1: {9: 10}})
    assert kept(comp.compress(0, k, v, q=q)) == [[4, 5, 6, 12, 13, 14, 15], [8, 9, 10, 12, 13, 14, 15]]


def test_snapkv_budget_below_window_keeps_most_recent():
    comp = make("snapkv", ratio=8, window_size=4)  # k = 2 < W
    k, v, q = snapkv_chunk({0: {1: 10}, 1: {2: 10}})
    assert kept(comp.compress(0, k, v, q=q)) == [[14, 15], [14, 15]]


def test_snapkv_ties_go_to_lower_index():
    comp = make("snapkv", ratio=2, window_size=4, kernel_size=1)
    k, v, q = snapkv_chunk({})  # every prefix key scores the same
    assert kept(comp.compress(0, k, v, q=q)) == [[0, 1, 2, 3, 12, 13, 14, 15]] * 2


def test_snapkv_requires_window_queries():
    k, v = random_kv()
    with pytest.raises(ValueError, match="trailing queries"):
        make("snapkv", window_size=4).compress(0, k, v, q=torch.zeros(3, 4, 4))


# ---------------------------------------------------------------- PyramidKV


def test_pyramid_budgets_four_layers_exact():
    assert pyramid_budgets(4, mean=16, chunk_size=64, beta=20) == [31, 21, 11, 1]  # T=64, R=4
    assert pyramid_budgets(4, mean=8, chunk_size=64, beta=20) == [15, 10, 6, 1]  # R=8: 15, 10.33, 5.67, 1
    assert pyramid_budgets(4, mean=42, chunk_size=64, beta=20) == [64, 49, 35, 20]  # capped at T


def test_pyramidkv_layouts_sum_to_snapkv_total():
    comp = make("pyramidkv", chunk_size=64, num_layers=4, window_size=8)
    assert [comp.layout(layer).rows for layer in range(4)] == [31, 21, 11, 1]
    assert sum(comp.layout(layer).rows for layer in range(4)) == 4 * 64 // 4


def test_pyramidkv_top_layer_keeps_its_budget_with_snapkv_rule():
    comp = make("pyramidkv", ratio=2, num_layers=2, window_size=4, kernel_size=1)  # budgets [15, 1]
    k, v, q = snapkv_chunk({0: {1: 10}, 1: {2: 10}})
    assert kept(comp.compress(1, k, v, q=q)) == [[15], [15]]
    # 15 = window 12..15 + 11 of the 12 prefix keys: the aligned one, then ties to the lower index
    assert kept(comp.compress(0, k, v, q=q)) == [[i for i in range(16) if i != 11]] * 2


@pytest.mark.parametrize("name", TOKEN_DROP)
def test_token_drop_at_ratio_one_keeps_every_token(name):
    comp = make(name, ratio=1, num_layers=2, window_size=4)
    k, v = random_kv()
    q = chunk_queries(comp, 0, d=4, dtype=torch.float32)
    for layer in range(2):
        chunk = comp.compress(layer, k, v, q=q, positions=torch.arange(16))
        assert kept(chunk) == [list(range(16))] * 2
        kd, vd = comp.decompress(layer, chunk)
        assert torch.equal(kd, k) and torch.equal(vd, v)


# ---------------------------------------------------------------- H2O and K-norm


def test_h2o_keeps_heavy_hitters_and_recent():
    comp = make("h2o", chunk_size=8, ratio=2)  # k = 4: 2 recent + 2 heavy
    assert comp.query_window(0) == 8
    k, v = torch.zeros(8, 2, 4), torch.randn(8, 2, 4)
    k[1, 0, 0], k[3, 0, 0], k[0, 1, 1], k[4, 1, 1] = 10.0, 10.0, 10.0, 10.0
    q = torch.zeros(8, 4, 4)
    q[:, 0:2, 0], q[:, 2:4, 1] = 1.0, 1.0
    chunk = comp.compress(0, k, v, q=q)
    assert kept(chunk) == [[1, 3, 6, 7], [0, 4, 6, 7]]
    assert_rows_are(comp, chunk, k, v, kept(chunk))


def test_h2o_accumulation_favours_early_keys_under_uniform_attention():
    comp = make("h2o", chunk_size=8, ratio=2)  # key j gets sum_{i >= j} 1 / (i + 1): decreasing in j
    k, v = random_kv(t=8)
    assert kept(comp.compress(0, k, v, q=torch.zeros(8, 4, 4))) == [[0, 1, 6, 7]] * 2


def test_knorm_keeps_lowest_key_norms_ties_to_lower_index():
    comp = make("knorm", chunk_size=8, ratio=2)  # k = 4
    k, v = torch.zeros(8, 2, 4), torch.randn(8, 2, 4)
    k[:, 0, 2] = torch.tensor([8.0, 1, 7, 2, 6, 3, 5, 4])
    k[:, 1, 3] = torch.tensor([-1.0, 1, 1, -1, 1, 1, 2, 2])
    chunk = comp.compress(0, k, v)
    assert kept(chunk) == [[1, 3, 5, 7], [0, 1, 2, 3]]
    assert_rows_are(comp, chunk, k, v, kept(chunk))


# ---------------------------------------------------------------- quantizers


def test_directed_float16_rounding():
    x = torch.tensor([1 / 3, -1 / 3, 100.01, 0.5])
    up, down = f16_at_least(x), f16_at_most(x)
    assert torch.all(up.float() >= x) and torch.all(down.float() <= x)
    assert up[3].item() == down[3].item() == 0.5  # representable values stay
    assert torch.equal(torch.nextafter(down[:3], up[:3]), up[:3])  # adjacent float16 values


def test_pack_codes_layout_and_round_trip():
    assert pack_codes(torch.tensor([[0, 1, 2, 3], [3, 0, 1, 2]]), 2).flatten().tolist() == [228, 147]
    assert pack_codes(torch.tensor([5, 10, 15, 0]), 4).tolist() == [165, 15]
    codes = torch.randint(0, 16, (3, 2, 64), generator=torch.Generator().manual_seed(1))
    for bits in (2, 4):
        c = codes % (1 << bits)
        assert torch.equal(unpack_codes(pack_codes(c, bits), bits), c)


def f32_eps(x: torch.Tensor) -> torch.Tensor:
    """Slack for the float32 arithmetic of dequantization (a few ulps of x)."""
    return 2.0**-22 * (x.abs() + 1)


def kivi_kv(seed: int, spread: float = 3.0, offset: float = 0.0):
    k, v = random_kv(t=64, h=2, d=64, seed=seed)
    return k * spread + offset, v * spread / 3 + offset


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("spread,offset", [(3.0, 0.0), (0.001, 100.05)])  # 2nd: min rounds up in float16
def test_kivi_error_within_half_step_of_group_scale(bits, spread, offset):
    comp = make(f"kivi{bits}", chunk_size=64, head_dim=64, group_size=32)
    k, v = kivi_kv(seed=bits, spread=spread, offset=offset)
    chunk = comp.compress(0, k, v)
    kd, vd = comp.decompress(0, chunk)
    k_step = chunk["k_scale"].float().repeat_interleave(32, dim=0)  # [T, H, D]: scale of each key's group
    v_step = chunk["v_scale"].float().repeat_interleave(32, dim=2)
    assert torch.all((k - kd).abs() <= k_step / 2 + f32_eps(k))
    assert torch.all((v - vd).abs() <= v_step / 2 + f32_eps(v))


@pytest.mark.parametrize("bits,step", [(2, 0.5), (4, 0.25)])
def test_kivi_grid_values_reconstruct_exactly(bits, step):
    levels = (1 << bits) - 1
    comp = make(f"kivi{bits}", chunk_size=64, head_dim=64, group_size=32)
    grid = -1 + step * (torch.arange(64) % (levels + 1)).float()
    k = grid[:, None, None].expand(64, 2, 64).clone()  # each key group spans all levels per channel
    v = grid[None, None, :].expand(64, 2, 64).clone()  # each value group spans all levels per token
    chunk = comp.compress(0, k, v)
    assert torch.all(chunk["k_scale"] == step) and torch.all(chunk["k_zero"] == -1)
    assert torch.all(chunk["v_scale"] == step) and torch.all(chunk["v_zero"] == -1)
    kd, vd = comp.decompress(0, chunk)
    assert torch.equal(kd, k) and torch.equal(vd, v)


def test_int8_error_within_half_step_and_grid_exact():
    comp = make("int8", chunk_size=64, head_dim=64)
    k, v = kivi_kv(seed=3)
    chunk = comp.compress(0, k, v)
    kd, vd = comp.decompress(0, chunk)
    for x, xd, s in ((k, kd, chunk["k_scale"]), (v, vd, chunk["v_scale"])):
        assert torch.all((x - xd).abs() <= s.float()[..., None] / 2 + f32_eps(x))
    grid = make("int8")
    k = torch.zeros(16, 2, 4)
    k[:] = 0.125 * torch.tensor([127.0, -3, 0, 5])
    chunk = grid.compress(0, k, k)
    assert torch.all(chunk["k_scale"] == 0.125) and chunk["k"][0, 0].tolist() == [127, -3, 0, 5]
    assert torch.equal(grid.decompress(0, chunk)[0], k)


def fp8_half_ulp(scaled: torch.Tensor) -> torch.Tensor:
    """Half the e4m3fn grid spacing at |scaled|: 3 mantissa bits, smallest normal exponent -6."""
    exponent = torch.floor(torch.log2(scaled.abs().clamp_min(2.0**-6)))
    return 2.0 ** (exponent - 3) / 2


def test_fp8_error_within_half_ulp_and_grid_exact():
    comp = make("fp8", chunk_size=64, head_dim=64)
    k, v = kivi_kv(seed=4)
    chunk = comp.compress(0, k, v)
    assert chunk["k"].dtype == torch.float8_e4m3fn
    kd, vd = comp.decompress(0, chunk)
    for x, xd, s in ((k, kd, chunk["k_scale"]), (v, vd, chunk["v_scale"])):
        s = s.float()[..., None]
        assert torch.all((x - xd).abs() <= s * fp8_half_ulp(x / s) + f32_eps(x))
    grid = make("fp8")
    k = torch.zeros(16, 2, 4)
    k[:] = 0.5 * torch.tensor([448.0, -1.5, 0.25, 3.5])
    chunk = grid.compress(0, k, k)
    assert torch.all(chunk["k_scale"] == 0.5)
    assert torch.equal(grid.decompress(0, chunk)[0], k)


# ---------------------------------------------------------------- layouts and bytes per token

# H_kv=2, D=64, T=64, bf16 exact tier: 2 (K,V) * 2 heads * 64 * 2 bytes = 512 bytes/token/layer.
# token drop R=4: 16 rows * (512 K/V + 2 heads * 2 index bytes) / 64 = 129
# kivi2: codes 2 * 128 * 2/8 = 64 (1/8 of 512); key scale+zero 2 * 128 * 2 B / 32 tokens = 16;
#        value scale+zero 2 heads * 2 groups * 2 * 2 B = 16 per token -> 96. kivi4: 128 + 32 = 160.
# int8 / fp8: codes 256 + one float16 scale per (token, head) for K and V: 2 * 2 * 2 = 8 -> 264.
# kvquant3: codes 2 * 128 * 3/8 = 96; key scale+zero per channel 2 * 128 * 2 B / 64 = 8; value
#        scale+zero per (token, head) 2 * 2 * 2 B = 8; levels 2 * 8 * 2 B / 64 = 0.5; outliers
#        round(1% of 8192) = 82 per K and V, bf16 value + int16 index: 2 * 82 * 4 / 64 = 10.25;
#        positions int32: 4 -> 126.75. kvquant4: codes 128, levels 2 * 16 * 2 / 64 = 1 -> 159.25.
# rotatekv2: codes 64; scale+zero per (token, head, 32 channels) for K and V: 2 * 2 * 2 * 2 * 2 B = 32;
#        positions 4 -> 100. rotatekv4: 128 + 32 + 4 = 164.
EXPECTED_BYTES_PER_TOKEN = {
    "streamingllm": 129.0, "snapkv": 129.0, "h2o": 129.0, "knorm": 129.0,
    "expected_attention": 129.0, "kvzip": 129.0, "kvzip_proxy": 129.0, "kvzap": 129.0,
    "kivi2": 96.0, "kivi4": 160.0, "int8": 264.0, "fp8": 264.0,
    "kvquant3": 126.75, "kvquant4": 159.25, "rotatekv2": 100.0, "rotatekv4": 164.0,
}  # fmt: skip


def shape_config(name: str, ratio: float = 4) -> CompressorConfig:
    shape = dict(chunk_size=64, num_layers=4, num_kv_heads=2, num_q_heads=4, head_dim=64)
    if name.startswith("kvzap"):
        shape["kvzap_path"] = random_surrogate(4)
    return CompressorConfig(name, ratio, dtype=torch.bfloat16, **shape)


def test_exact_tier_bytes_per_token():
    assert exact_bytes_per_token(shape_config("int8")) == 512


@pytest.mark.parametrize("name", sorted(EXPECTED_BYTES_PER_TOKEN))
def test_bytes_per_token_per_layer(name):
    comp = get_compressor(name, shape_config(name))
    per_layer = [comp.layout(layer).bytes_per_token() for layer in range(4)]
    assert per_layer == [EXPECTED_BYTES_PER_TOKEN[name]] * 4


def test_pyramidkv_bytes_per_token_total_equals_snapkv():
    # rows [31, 21, 11, 1]; each row stores 2 * 2 * 64 * 2 + 2 * 2 = 516 bytes
    comp = get_compressor("pyramidkv", shape_config("pyramidkv"))
    assert [comp.layout(layer).chunk_nbytes() for layer in range(4)] == [516 * r for r in (31, 21, 11, 1)]
    assert comp.bytes_per_token() == 4 * 129.0


@pytest.mark.parametrize("name", COMPRESSOR_NAMES)
def test_every_chunk_matches_its_static_layout(name):
    comp = get_compressor(name, shape_config(name))
    g = torch.Generator().manual_seed(7)
    for layer in range(4):
        k, v = torch.randn(64, 2, 64, generator=g).bfloat16(), torch.randn(64, 2, 64, generator=g).bfloat16()
        q = chunk_queries(comp, layer, g=g)
        chunk = comp.compress(layer, k, v, q=q, positions=torch.arange(64))
        layout = comp.layout(layer)
        assert chunk.matches(layout) and chunk.nbytes() == layout.chunk_nbytes()
        kd, vd = comp.decompress(layer, chunk)
        assert kd.shape == vd.shape == (layout.rows, 2, 64) and kd.dtype == vd.dtype == torch.float32


@pytest.mark.parametrize("name", COMPRESSOR_NAMES)
def test_batched_chunks_equal_chunk_by_chunk(name):
    comp = get_compressor(name, shape_config(name))
    g = torch.Generator().manual_seed(8)
    k, v = (torch.randn(3, 64, 2, 64, generator=g).bfloat16() for _ in range(2))
    positions = torch.arange(3 * 64).view(3, 64)  # sinks only in chunk 0
    q = chunk_queries(comp, 1, lead=(3,), g=g)
    batched = comp.compress(1, k, v, q=q, positions=positions)
    assert batched.matches(comp.layout(1)) and batched.batch_shape(comp.layout(1)) == (3,)
    kd, vd = comp.decompress(1, batched)
    for i in range(3):
        qi = None if q is None else q[i] if isinstance(q, torch.Tensor) else type(q)(q.q[i], q.k[i], q.sink_k[i])
        one = comp.compress(1, k[i], v[i], q=qi, positions=positions[i])
        assert all(torch.equal(batched[n][i], t) for n, t in one.tensors.items())
        ki, vi = comp.decompress(1, one)
        assert torch.equal(kd[i], ki) and torch.equal(vd[i], vi)


# ---------------------------------------------------------------- registry


def test_registry_constructs_every_name():
    for name in COMPRESSOR_NAMES:
        assert get_compressor(name, shape_config(name)).name == name
    assert set(COMPRESSOR_NAMES) == {*TOKEN_DROP, *QUANTIZERS}


def test_unknown_name_lists_the_names():
    with pytest.raises(ValueError) as err:
        get_compressor("zip", shape_config("zip"))
    assert all(name in str(err.value) for name in COMPRESSOR_NAMES)


def test_config_for_another_compressor_is_rejected():
    with pytest.raises(ValueError, match="config for 'knorm'"):
        get_compressor("snapkv", shape_config("knorm"))


def test_fp8_without_float8_dtype_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        get_compressor("fp8", shape_config("fp8"))


def test_config_from_model_config_takes_shape_and_dtype():
    fields = {"num_hidden_layers", "num_key_value_heads", "num_attention_heads", "head_dim", "dtype"}
    assert fields <= ModelConfig.__dataclass_fields__.keys()
    model = SimpleNamespace(
        num_hidden_layers=3, num_key_value_heads=2, num_attention_heads=8, head_dim=32, dtype=torch.float16
    )
    cfg = CompressorConfig.from_model_config("snapkv", 4, 32, model, window_size=4)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.num_q_heads, cfg.head_dim) == (3, 2, 8, 32)
    assert cfg.dtype == torch.float16 and cfg.window_size == 4 and cfg.budget == 8


@pytest.mark.parametrize(
    "bad",
    [{"ratio": 0.5}, {"num_q_heads": 3}, {"kernel_size": 4}, {"pooling": "sum"}, {"h2o_recent_fraction": 2}],
)
def test_config_rejects_bad_options(bad):
    args = dict(ratio=4, chunk_size=16, num_layers=1, num_kv_heads=2, num_q_heads=4, head_dim=4) | bad
    with pytest.raises(ValueError):
        CompressorConfig("snapkv", **args)


def test_kivi_key_group_shrinks_to_small_chunk_and_rejects_misaligned_shapes():
    comp = make("kivi2", chunk_size=16, head_dim=64, group_size=32)  # key groups of T = 16 tokens
    shapes = {spec.name: spec.shape for spec in comp.layout(0).tensors}
    assert shapes["k_scale"] == (1, 2, 64) and shapes["v_scale"] == (16, 2, 2) and shapes["k"] == (16, 2, 16)
    with pytest.raises(ValueError, match="multiples of group_size"):
        make("kivi2", chunk_size=48, head_dim=64, group_size=32)


def test_kivi_ignores_ratio():
    assert get_compressor("kivi2", shape_config("kivi2", ratio=8)).layout(0).bytes_per_token() == 96.0
    assert math.isclose(get_compressor("kivi2", shape_config("kivi2")).effective_ratio(), 512 / 96)
