"""Head-adaptive budgets (AdaKV; --kv-head-budget adaptive): one top-k over a layer's (KV head, token)
scores with kvpress's safeguard, cells tagged with their KV head, the draft attention of head h over
the cells tagged h (fused CPU kernel and torch path), and VeriCache still deterministic full mode's
tokens and logprobs bitwise; global budgets (--kv-head-budget global): one top-k over every layer, a
segment's chunks dealt to the layers by their counts; --kv-head-budget auto resolving to each method's own."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.compress.base import CompressorConfig
from sglang_vericache.compress.head_budget import adaptive_keep, deal_cells, global_keep
from sglang_vericache.compress.registry import get_compressor
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs, bundled_model_path
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import random_prompts, run_batch
from test_segment_compression import spiky_segment  # the same spiky segment, 4 queries after it

T, H_KV, H_Q, D = 8, 2, 4, 16


def config(name: str, ratio: float = 8, **options) -> CompressorConfig:
    return CompressorConfig(name, ratio=ratio, chunk_size=T, num_layers=1, num_kv_heads=H_KV, num_q_heads=H_Q,
                            head_dim=D, dtype=torch.float32, **options)


def test_adaptive_keep_is_one_top_k_over_heads_after_each_heads_safeguard():
    scores = torch.tensor([[9.0, 8.0, 7.0, 6.0, 5.0, 0.4],
                           [0.1, 0.3, 0.2, float("inf"), 0.0, 0.5]])
    # kept 3 per head: 6 cells; safeguard floor(3 * 0.5) = 1 per head (head 1's is its +inf sink)
    mask = adaptive_keep(scores, 3, 0.5)
    assert mask.int().tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 0, 0]]
    # safeguard floor(3 * 0.7) = 2: head 1 keeps its sink and 0.5, head 0 the other four cells
    assert adaptive_keep(scores, 3, 0.7).int().tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 0, 1]]
    # safeguard 1: every head its own top 3 (a uniform budget)
    assert adaptive_keep(scores, 3, 1.0).int().tolist() == [[1, 1, 1, 0, 0, 0], [0, 1, 0, 1, 0, 1]]
    token, head = deal_cells(adaptive_keep(scores, 3, 0.5), 3, 1)  # 3 chunks of 1 row x 2 heads
    assert token.flatten().tolist() == [0, 1, 2, 3, 3, 4] and head.flatten().tolist() == [0, 0, 0, 0, 1, 0]


def test_global_keep_ranks_every_layer_at_once_in_whole_chunks():
    inf = float("inf")
    # 2 layers, 1 head, 2 pages of 2 tokens, 1 row per page: 4 cells over both layers, one per chunk
    masks, chunks = global_keep([torch.tensor([[9.0, 8.0, 7.0, 1.0]]), torch.tensor([[0.5, 6.0, 0.2, 0.1]])], 2, 1)
    assert chunks == [3, 1] and [m.int().tolist() for m in masks] == [[[1, 1, 1, 0]], [[0, 1, 0, 0]]]
    # 2 heads (2 cells a chunk): layer 0 wins 5 of the 8 cells, layer 1 3: floors 2 / 1, the spare chunk to
    # the lower layer on equal remainders; each layer then keeps its own top 2 * chunks cells
    masks, chunks = global_keep([torch.tensor([[9.0, 8.0, 7.0, 1.5], [6.0, 0.0, 0.0, 0.0]]),
                                 torch.tensor([[5.0, 4.0, 0.0, 0.0], [3.0, 1.0, 0.0, 0.0]])], 2, 1)
    assert chunks == [3, 1]
    assert [m.int().tolist() for m in masks] == [[[1, 1, 1, 1], [1, 1, 0, 0]], [[1, 1, 0, 0], [0, 0, 0, 0]]]
    # 3 rows a chunk, 8 tokens: a layer holds at most 8 // 3 = 2 chunks, so layer 0's larger remainder
    # (8 cells: 2 chunks + 2) cannot take the spare chunk and layer 1 (4 cells: 1 + 1) does; +inf is kept
    low = torch.arange(1.0, 9.0)[None] / 10
    masks, chunks = global_keep([torch.full((1, 8), 9.0), low], 2, 3)
    assert chunks == [2, 2]
    assert [m.int().tolist() for m in masks] == [[[1, 1, 1, 1, 1, 1, 0, 0]], [[0, 0, 1, 1, 1, 1, 1, 1]]]
    masks, chunks = global_keep([torch.zeros(1, 4), torch.tensor([[inf, inf, inf, 0.0]])], 2, 1)
    assert chunks == [1, 3] and masks[1].int().tolist() == [[1, 1, 1, 0]]


def test_snapkv_adaptive_gives_the_spread_head_more_cells_and_stores_each_cells_head():
    """Head 0 spreads its attention over 6 tokens, head 1 over 2: a uniform budget of 4 per head drops two of
    head 0's; the adaptive one keeps all 6 of head 0's and head 1's 2, in 4 chunks of 1 row x 2 heads."""
    hot = {0: [2, 5, 9, 14, 21, 30], 1: [7, 19]}
    k, v, q, q_pos, pos = spiky_segment(hot, queries=4)
    uniform = get_compressor("snapkv", config("snapkv", kernel_size=1, window_size=4))
    adaptive = get_compressor("snapkv", config("snapkv", kernel_size=1, window_size=4, head_budget="adaptive",
                                               alpha_safeguard=0.25))
    assert [t.name for t in adaptive.layout(0).tensors] == ["k", "v", "idx", "head"]
    u = uniform.compress_segment(0, k, v, q=q, q_positions=q_pos, positions=pos)
    a = adaptive.compress_segment(0, k, v, q=q, q_positions=q_pos, positions=pos)
    assert sorted(u["idx"][..., 0].flatten().tolist()) != hot[0]  # uniform: 4 of head 0's 6
    cells = sorted(zip(a["head"].flatten().tolist(), a["idx"].flatten().tolist()))
    assert cells == [(0, t) for t in hot[0]] + [(1, t) for t in hot[1]]
    assert a["k"].shape == u["k"].shape == (4, 1, H_KV, D)  # the same storage
    for c, j, col in torch.cartesian_prod(torch.arange(4), torch.arange(1), torch.arange(H_KV)).tolist():
        t, h = int(a["idx"][c, j, col]), int(a["head"][c, j, col])
        assert torch.equal(a["k"][c, j, col], k[t, h]) and torch.equal(a["v"][c, j, col], v[t, h])


def test_full_safeguard_keeps_the_uniform_sets():
    k, v, q, q_pos, pos = spiky_segment({0: [2, 5, 9, 14, 21, 30], 1: [7, 19]}, seed=3, queries=4)
    uniform = get_compressor("expected_attention", config("expected_attention"))
    adaptive = get_compressor("expected_attention", config("expected_attention", head_budget="adaptive",
                                                           alpha_safeguard=1.0))
    u = uniform.compress_segment(0, k, v, q=q, q_positions=q_pos, positions=pos)
    a = adaptive.compress_segment(0, k, v, q=q, q_positions=q_pos, positions=pos)
    want = {(h, t) for h in range(H_KV) for t in u["idx"][..., h].flatten().tolist()}
    assert set(zip(a["head"].flatten().tolist(), a["idx"].flatten().tolist())) == want


def test_methods_without_a_score_refuse_adaptive_budgets():
    k, v, q, q_pos, pos = spiky_segment({0: [1], 1: [2]}, queries=4)
    for name in ("h2o", "streamingllm"):
        comp = get_compressor(name, config(name, head_budget="adaptive"))
        with pytest.raises(ValueError, match="not a per-token score"):
            comp.compress_segment(0, k, v, q=q, q_positions=q_pos, positions=pos)


# ------------------------------------------------------------------ the fused CPU kernel


def tagged_reference(q, k, v, head, ids, lens, tail, scale):
    """Per request and KV head h: softmax attention (float64) over the cells tagged h, then the tail."""
    from sgl_kernel_ext.cpu_draft_attention import draft_decode_attention_ref

    tk, tv, ti, tl = tail
    g = q.shape[1] // k.shape[2]
    out = torch.zeros(q.shape)
    for b in range(q.shape[0]):
        for h in range(k.shape[2]):
            at = [(c, j, col) for c in ids[b, : lens[b]].tolist() for j in range(k.shape[1]) for col in range(k.shape[2])
                  if head[c, j, col] == h]
            slots = ti[b, : tl[b]].tolist()
            ks = torch.stack([k[c, j, col].float() for c, j, col in at] + [tk[s, h].float() for s in slots])
            vs = torch.stack([v[c, j, col].float() for c, j, col in at] + [tv[s, h].float() for s in slots])
            ref = draft_decode_attention_ref(q[b : b + 1, h * g : (h + 1) * g], [ks[:, None]], [vs[:, None]], scale)
            out[b, h * g : (h + 1) * g] = ref[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_attends_each_head_to_its_tagged_cells(dtype):
    from sgl_kernel_ext.cpu_draft_attention import CompressedLayer, draft_decode_attention

    g = torch.Generator().manual_seed(0)
    b, h, hkv, d, r, nc = 3, 6, 3, 64, 4, 7
    k = torch.randn(nc, r, hkv, d, generator=g).to(dtype)
    v = torch.randn(nc, r, hkv, d, generator=g).to(dtype)
    head = torch.randint(0, hkv, (nc, r, hkv), generator=g, dtype=torch.int8)
    head[5] = 0  # a chunk whose cells are all head 0's: heads 1 and 2 read none of it
    q = torch.randn(b, h, d, generator=g)
    ids, lens = torch.tensor([[1, 3, 5, 0], [2, 4, 1, 6], [5, 0, 0, 0]]), torch.tensor([3, 4, 1])
    tail = (torch.randn(12, hkv, d, generator=g).to(dtype), torch.randn(12, hkv, d, generator=g).to(dtype),
            torch.tensor([[1, 2, 0], [3, 0, 0], [4, 5, 6]]), torch.tensor([2, 1, 3]))
    out = draft_decode_attention(q, CompressedLayer("token_drop", 0, (k, v, head)), ids, lens, tail, None, 0.125)
    ref = tagged_reference(q, k, v, head, ids, lens, tail, 0.125)
    assert (out - ref).abs().max().item() < 2e-6
    # untagged (head[j, c] = c) reads the same rows as the plain token-drop layout, bitwise
    own = torch.arange(hkv, dtype=torch.int8).expand(nc, r, hkv).contiguous()
    plain = draft_decode_attention(q, CompressedLayer("token_drop", 0, (k, v)), ids, lens, tail, None, 0.125)
    tagged = draft_decode_attention(q, CompressedLayer("token_drop", 0, (k, v, own)), ids, lens, tail, None, 0.125)
    assert torch.equal(plain, tagged)


@pytest.mark.parametrize("deterministic", [True, False], ids=["invariant_kernel", "sdpa"])
def test_torch_path_attends_each_head_to_its_tagged_cells(deterministic):
    """torch_backend's path over head-tagged chunks (head_tagged.tagged_draft_attention) against the float64
    reference: padded chunks and tails, a chunk whose cells are all one head's."""
    from types import SimpleNamespace

    from sglang_vericache.compress.base import Layout
    from sglang_vericache.layers.attention.draft_metadata import _compressed_index
    from sglang_vericache.layers.attention.head_tagged import tagged_draft_attention

    g = torch.Generator().manual_seed(1)
    b, h, hkv, d, r, nc = 3, 6, 3, 64, 4, 7
    k, v = torch.randn(nc, r, hkv, d, generator=g), torch.randn(nc, r, hkv, d, generator=g)
    head = torch.randint(0, hkv, (nc, r, hkv), generator=g, dtype=torch.int8)
    head[5] = 2
    q = torch.randn(b, h, d, generator=g)
    ids, lens = torch.tensor([[1, 3, 5, 0], [2, 4, 1, 6], [5, 0, 0, 0]]), torch.tensor([3, 4, 1])
    tk, tv = torch.randn(12, hkv, d, generator=g), torch.randn(12, hkv, d, generator=g)
    ti, tl = torch.tensor([[1, 2, 0], [3, 0, 0], [4, 5, 6]]), torch.tensor([2, 1, 3])
    layout = Layout("token_drop", 16, r, ())
    ci = _compressed_index(ids, torch.arange(4)[None, :] < lens[:, None], layout)
    md = SimpleNamespace(batch_size=b, tail_valid=torch.arange(3)[None, :] < tl[:, None], draft_valid=None)
    layer = SimpleNamespace(num_kv_heads=hkv, num_heads=h, head_dim=d, v_head_dim=d, scaling=0.125)
    rest = [(tk, tv, ti.T.reshape(-1))]
    out = tagged_draft_attention(q, layer, {"k": k, "v": v, "head": head}, ci, md, rest, deterministic)
    ref = tagged_reference(q, k, v, head, ids, lens, (tk, tv, ti, tl), 0.125)
    assert (out.view(b, h, d) - ref).abs().max().item() < 2e-6


# ------------------------------------------------------------------ the scheduler

PROMPT_LENS = [40, 71, 9, 33]
NEW = 24


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


def run(path, dtype, page_size=8, **server):
    return run_batch(path, random_prompts(PROMPT_LENS, seed=5), NEW, dtype=dtype, page_size=page_size, **server)


@pytest.fixture(scope="module")
def full(llama):
    return {dtype: run(llama, dtype)[0] for dtype in ("bfloat16", "float32")}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_path"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("compressor", ["snapkv", "expected_attention", "kvzip"])
def test_adaptive_budget_output_equals_deterministic_full_mode(llama, full, compressor, dtype, fused, monkeypatch):
    from sglang_vericache.layers.attention import torch_backend

    calls = []
    real = torch_backend.tagged_draft_attention
    monkeypatch.setattr(torch_backend, "tagged_draft_attention", lambda *a: calls.append(1) or real(*a))
    if not fused:
        monkeypatch.setattr(torch_backend, "fused_draft_available", lambda: False)
    vc, sched = run(llama, dtype, kv_compressor=compressor, kv_compression_ratio=4, kv_head_budget="adaptive",
                    speculative_algorithm="VERICACHE", speculative_num_draft_tokens="4", vericache_schedule="lockstep",
                    kv_recent_window=8)
    assert sched.two_tier.segment_scope and sched.two_tier.compressor.head_adaptive
    assert [r.output_ids for r in vc] == [r.output_ids for r in full[dtype]]
    assert [r.output_token_logprobs for r in vc] == [r.output_token_logprobs for r in full[dtype]]
    assert sched.metrics.spec_rounds_total > 0
    assert bool(calls) != fused  # the torch path read the tagged cells only where the kernel did not
    assert moved_cells(sched) > 0  # some head kept more than its uniform share (cells outside its column)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_path"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("compressor", ["expected_attention", "kvzip"])
def test_global_budget_output_equals_deterministic_full_mode(llama, full, compressor, dtype, fused, monkeypatch):
    """Global budgets: each segment's L * n flat chunks are dealt whole to the layers, every dealt cell holds
    its own layer's K / V of the token and head it names, the layers' counts differ, and VeriCache's tokens and
    logprobs are deterministic full mode's bitwise, from the fused kernel and from the torch path."""
    from sglang_vericache.layers.attention import torch_backend
    from sglang_vericache.mem_cache import two_tier

    counts = []
    real = two_tier.compress_segment

    def checked(comp, kv_pool, pool, slots, ids, *rest):
        chunks = real(comp, kv_pool, pool, slots, ids, *rest)
        counts.append(dealt_counts(kv_pool, pool, slots, ids, chunks))
        return chunks

    monkeypatch.setattr(two_tier, "compress_segment", checked)
    if not fused:
        monkeypatch.setattr(torch_backend, "fused_draft_available", lambda: False)
    vc, sched = run(llama, dtype, kv_compressor=compressor, kv_compression_ratio=4, kv_head_budget="global",
                    speculative_algorithm="VERICACHE", speculative_num_draft_tokens="4", vericache_schedule="lockstep",
                    kv_recent_window=8)
    assert sched.two_tier.compressor.layer_global
    assert [r.output_ids for r in vc] == [r.output_ids for r in full[dtype]]
    assert [r.output_token_logprobs for r in vc] == [r.output_token_logprobs for r in full[dtype]]
    assert sched.metrics.spec_rounds_total > 0
    assert counts and all(sum(c) == len(c) * n for c, n in counts)
    assert any(len(set(c)) > 1 for c, _ in counts)  # some layer kept more than its uniform share


def dealt_counts(kv_pool, pool, slots, ids, chunks, tagged: bool = True) -> tuple[list[int], int]:
    """Checks one dealt segment (every flat chunk of its ids handed to one layer, each holding that layer's
    K / V of the token and head it names); returns (each layer's chunk count, the segment's pages)."""
    every = torch.cat([pool.layer_chunks(layer, ids) for layer in range(pool.num_layers)])
    assert sorted(torch.cat(chunks).tolist()) == sorted(every.tolist())  # each flat chunk dealt once
    for layer, mine in enumerate(chunks):
        k, v = (pool.flat[name][mine] for name in ("k", "v"))
        token = pool.flat["idx"][mine].long()
        head = pool.flat["head"][mine].long() if tagged else torch.arange(k.shape[2]).expand(token.shape)
        exact_k = kv_pool.get_key_buffer(layer)[slots.to(kv_pool.device)]  # [S, H_kv, D]
        exact_v = kv_pool.get_value_buffer(layer)[slots.to(kv_pool.device)]
        assert torch.equal(k, exact_k[token, head].to(k.dtype)) and torch.equal(v, exact_v[token, head].to(v.dtype))
    return [len(c) for c in chunks], len(ids)


def moved_cells(sched) -> int:
    """Cells of the compressed pool (freed chunks keep their bytes) that hold another column's head."""
    pool = sched.two_tier.pool
    own = torch.arange(pool.compressor.config.num_kv_heads, dtype=torch.int8)
    return sum(int((bufs["head"][1:] != own).sum()) for bufs in pool.buffers)


@pytest.fixture(scope="module")
def bundled_full():
    return {dtype: run(bundled_model_path(), dtype, page_size=16)[0] for dtype in ("bfloat16", "float32")}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("compressor", ["snapkv", "kvzip"])
def test_adaptive_budget_on_the_bundled_model_equals_deterministic_full_mode(bundled_full, compressor, dtype):
    """The bundled model, pages of 16, a mixed batch: the fused kernel drafts from head-tagged cells; VeriCache's
    tokens and logprobs are deterministic full mode's bitwise, in bfloat16 and float32."""
    vc, sched = run(bundled_model_path(), dtype, page_size=16, kv_compressor=compressor, kv_compression_ratio=4,
                    kv_head_budget="adaptive", speculative_algorithm="VERICACHE", speculative_num_draft_tokens="4",
                    vericache_schedule="lockstep", kv_recent_window=8)
    assert [r.output_ids for r in vc] == [r.output_ids for r in bundled_full[dtype]]
    assert [r.output_token_logprobs for r in vc] == [r.output_token_logprobs for r in bundled_full[dtype]]
    assert sched.metrics.spec_rounds_total > 0
    assert moved_cells(sched) > 0


def test_adaptive_budget_refuses_page_scope_compositions_and_unscored_methods(llama):
    for server, why in [(dict(kv_compressor="snapkv", kv_compress_scope="page"), "page scope"),
                        (dict(kv_compressor="snapkv+kivi4"), "composition"),
                        (dict(kv_compressor="h2o"), "not a per-token score"),
                        (dict(kv_compressor="int8"), "not a token dropper"),
                        (dict(kv_compressor="pyramidkv", kv_head_budget="global"), "layer budgets are its own")]:
        with pytest.raises(ValueError, match=why):
            Scheduler(ServerArgs(model_path=llama, dtype="float32", skip_tokenizer_init=True, page_size=8,
                                 **{"kv_head_budget": "adaptive", **server}, speculative_algorithm="VERICACHE"))


@pytest.mark.parametrize("compressor, server, adaptive", [
    ("kvzap", {}, True),  # auto: kvzap's own, global budgets (its paper's one threshold)
    ("kvzap", {"kv_head_budget": "uniform"}, False),  # an explicit value wins
    ("kvzap", {"kv_compress_scope": "page"}, False),  # a page alone keeps a uniform budget
    ("kvzap+int8", {}, False),  # DROP+QUANT: uniform
    ("kvzip", {}, True),  # KVzip's own: its scores ranked across heads and layers (KVzipPress)
    ("snapkv", {}, False),  # the others' own: uniform
    ("snapkv", {"kv_head_budget": "adaptive"}, True),
])
def test_head_budget_auto_is_the_methods_own(compressor, server, adaptive):
    sched = Scheduler(ServerArgs(model_path=bundled_model_path(), dtype="bfloat16", page_size=16,
                                 kv_compressor=compressor, kv_compression_ratio=4, speculative_algorithm="VERICACHE",
                                 **server))
    drop = getattr(sched.two_tier.compressor, "drop", sched.two_tier.compressor)
    assert drop.head_adaptive == adaptive
    assert drop.layer_global == (adaptive and compressor != "snapkv")  # global: kvzip's and kvzap's own
