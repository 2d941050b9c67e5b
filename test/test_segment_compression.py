"""Token dropping over a whole segment (issue 37): a prompt's pages ranked together after its prefill,
with its last queries in view, the budget global over the segment; generated tokens folded past an
exact recent window; VeriCache still deterministic full mode's tokens and logprobs bitwise."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.compress.base import CompressorConfig
from sglang_vericache.compress.registry import get_compressor
from sglang_vericache.compress.token_drop import top_k_indices
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

T, H_KV, H_Q, D = 8, 2, 4, 16


def config(name: str, ratio: float = 8, layers: int = 1, **options) -> CompressorConfig:
    return CompressorConfig(name, ratio=ratio, chunk_size=T, num_layers=layers, num_kv_heads=H_KV,
                            num_q_heads=H_Q, head_dim=D, dtype=torch.float32, **options)


def spiky_segment(hot: dict[int, list[int]], pages: int = 4, seed: int = 0, queries: int = 3):
    """k, v [pages * T, H_KV, D] of small random keys, except that head h's keys at hot[h] point
    along channel 0 (scaled up), and queries [queries, H_Q, D] at positions after the segment that point
    along channel 0 too: they attend to the hot keys and hardly anywhere else."""
    g = torch.Generator().manual_seed(seed)
    s = pages * T
    k = torch.randn(s, H_KV, D, generator=g) * 0.01
    v = torch.randn(s, H_KV, D, generator=g)
    for h, rows in hot.items():
        k[rows, h, 0] = 4.0
    q = torch.zeros(queries, H_Q, D)
    q[..., 0] = 4.0
    return k, v, q, torch.arange(s, s + queries), torch.arange(s)


def test_snapkv_keeps_the_top_k_over_the_whole_segment_not_k_of_every_page():
    comp = get_compressor("snapkv", config("snapkv", kernel_size=1))  # k_l = 1 row per page and head
    hot = {0: [3, 17, 18, 30], 1: [0, 1, 2, 25]}  # page 1 has none of head 0's, page 0 three of head 1's
    k, v, q, q_pos, pos = spiky_segment(hot)
    chunks = comp.compress_segment(0, k, v, q=q, q_positions=q_pos, positions=pos)
    # Chunk i holds each head's kept tokens i * k_l .. (i + 1) * k_l - 1 in position order.
    assert chunks["idx"].tolist() == [[[3, 0]], [[17, 1]], [[18, 2]], [[30, 25]]]
    for h in range(H_KV):
        assert torch.equal(chunks["k"][:, 0, h], k[hot[h], h])
        assert torch.equal(chunks["v"][:, 0, h], v[hot[h], h])
    # Page by page the same budget keeps one token of every page: the window's own last token.
    pages = comp.compress(0, k.unflatten(0, (4, T)), v.unflatten(0, (4, T)), q=torch.zeros(4, T, H_Q, D),
                          positions=pos.unflatten(0, (4, T)))
    assert pages["idx"][..., 0].flatten().tolist() == [7, 7, 7, 7]


def reference_snapkv(k, q, q_pos, pos, scale, n_keep, kernel_size):
    """SnapKV written out per (KV head, q-head, query): softmax over the keys each query sees,
    summed, average-pooled, the keys inside the window kept first, the top n_keep (ties: lower)."""
    scores = torch.zeros(H_KV, len(pos))
    for h in range(H_KV):
        for g in range(H_Q // H_KV):
            for i in range(len(q_pos)):
                logits = torch.tensor([float(q[i, h * (H_Q // H_KV) + g] @ k[j, h]) * scale
                                       if pos[j] <= q_pos[i] else float("-inf") for j in range(len(pos))])
                scores[h] += torch.softmax(logits, dim=0)
    pad = kernel_size // 2
    pooled = torch.nn.functional.avg_pool1d(scores[:, None], kernel_size, stride=1, padding=pad)[:, 0]
    pooled[:, pos >= q_pos[0]] = float("inf")
    return top_k_indices(pooled, n_keep)


@pytest.mark.parametrize("window_inside", [False, True])
def test_snapkv_segment_matches_a_reference_top_k_over_the_whole_context(window_inside):
    comp = get_compressor("snapkv", config("snapkv", ratio=4, window_size=4))
    g = torch.Generator().manual_seed(1)
    s = 4 * T
    k, v = torch.randn(s, H_KV, D, generator=g), torch.randn(s, H_KV, D, generator=g)
    q = torch.randn(6, H_Q, D, generator=g)
    start = s - 2 if window_inside else s + 1  # the window's last queries: 2 of them inside the segment
    q_pos, pos = torch.arange(start - 2, start + 4), torch.arange(s)
    chunks = comp.compress_segment(0, k, v, q=q, q_positions=q_pos, positions=pos)
    want = reference_snapkv(k, q[-4:], q_pos[-4:], pos, comp.config.scale, 4 * 2, 5)  # [H, 8]
    assert chunks["idx"].permute(2, 0, 1).flatten(1).tolist() == want.tolist()
    if window_inside:
        assert {30, 31} <= set(want[0].tolist())


def test_budgets_are_exact_per_layer_over_the_segment():
    layers = 6
    comp = get_compressor("pyramidkv", config("pyramidkv", ratio=4, layers=layers, kernel_size=1))
    g = torch.Generator().manual_seed(2)
    pages = 5
    k, v = torch.randn(pages * T, H_KV, D, generator=g), torch.randn(pages * T, H_KV, D, generator=g)
    q, q_pos = torch.randn(8, H_Q, D, generator=g), torch.arange(pages * T - 8, pages * T)
    for layer in range(layers):
        rows = comp.rows(layer)
        chunks = comp.compress_segment(layer, k, v, q=q, q_positions=q_pos, positions=torch.arange(pages * T))
        assert chunks["idx"].shape == (pages, rows, H_KV)
        assert chunks.matches(comp.layout(layer))  # the pool's layout: k_l rows in every chunk
        for h in range(H_KV):
            kept = chunks["idx"][..., h].flatten()
            assert len(set(kept.tolist())) == pages * rows  # n * k_l distinct tokens of the segment
            assert kept.tolist() == sorted(kept.tolist())
    assert sum(comp.rows(layer) for layer in range(layers)) == layers * (T // 4)


def test_pyramidkv_segment_budgets_are_kvpress_with_its_snapkv_fallback():
    from fractions import Fraction

    from sglang_vericache.compress.pyramidkv import layer_budgets

    # 4x of 4,096 tokens: the smallest layer's 1024 // 20 = 51 is under the window (64): SnapKV's uniform 1024
    assert layer_budgets(30, 4096, 1024, 64, 20) == [Fraction(1024)] * 30
    # 4x of 8,000: 3,900 in layer 0 down to 100 in layer 29, mean 2,000
    b = layer_budgets(30, 8000, 2000, 64, 20)
    assert (b[0], b[29], sum(b) / 30) == (3900, 100, 2000)
    # 2x of 2,000, window 64: 1,950 would pass num_tokens - window: capped at 1,936, the smallest 2 * 1000 - 1936
    b = layer_budgets(3, 2000, 1000, 64, 20)
    assert b == [1936, 1000, 64]


def test_pyramidkv_deals_a_segments_chunks_by_its_layer_budgets():
    """3 layers, 4 pages of 8 at 4x (2 rows a page), window 4, beta 2: budgets 12 / 8 / 4 tokens per head, so
    layers 0-2 get 6 / 4 / 2 of the segment's 12 chunks, each its own SnapKV top 12 / 8 / 4 in position order."""
    comp = get_compressor("pyramidkv", config("pyramidkv", ratio=4, layers=3, kernel_size=1, window_size=4,
                                              pyramid_beta=2, segment_layers=True))
    assert comp.deals_layers and [comp.rows(layer) for layer in range(3)] == [2, 2, 2]
    g = torch.Generator().manual_seed(3)
    ranked = {}
    for layer in range(3):
        k, v = torch.randn(32, H_KV, D, generator=g), torch.randn(32, H_KV, D, generator=g)
        q = torch.randn(6, H_Q, D, generator=g)
        ranked[layer] = (k, v, comp.ranked_scores(layer, k, v, q, torch.arange(26, 32), torch.arange(32)))
    dealt = comp.deal_layers(ranked, 4)
    assert [dealt[layer][0] for layer in range(3)] == [6, 4, 2]
    for layer, kept in zip(range(3), (12, 8, 4)):
        k, v, scores = ranked[layer]
        chunk = dealt[layer][1]
        want = top_k_indices(scores, kept)  # [H, kept] ascending
        assert chunk["idx"].permute(2, 0, 1).flatten(1).tolist() == want.tolist()
        assert {28, 29, 30, 31} <= set(want[0].tolist())  # the window's keys first
        for h in range(H_KV):
            assert torch.equal(chunk["k"][..., h, :].flatten(0, 1), k[want[h], h])


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """3 layers (a pyramid has a middle), 1,024 positions."""
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama3")), num_hidden_layers=3,
                                  max_position_embeddings=1024)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pyramidkv_dealt_budgets_output_equals_deterministic_full_mode(llama3, dtype, monkeypatch):
    """Prompts long enough for a pyramid (its window set to 4 here): the layers' chunk counts differ, every
    dealt chunk holds its layer's K / V, and VeriCache is deterministic full mode's tokens and logprobs."""
    from sglang_vericache.compress import pyramidkv
    from sglang_vericache.mem_cache import two_tier
    from test_head_adaptive import dealt_counts

    monkeypatch.setattr(pyramidkv, "SEGMENT_WINDOW", 4)
    counts = []
    real = two_tier.compress_segment

    def checked(comp, kv_pool, pool, slots, ids, *rest):
        chunks = real(comp, kv_pool, pool, slots, ids, *rest)
        counts.append(dealt_counts(kv_pool, pool, slots, ids, chunks, tagged=False))
        return chunks

    monkeypatch.setattr(two_tier, "compress_segment", checked)
    lens = [420, 333]
    full_out = run(llama3, dtype, prompt_lens=lens)[0]
    vc, sched = run(llama3, dtype, prompt_lens=lens, kv_compressor="pyramidkv", kv_compression_ratio=4,
                    speculative_algorithm="VERICACHE", speculative_num_draft_tokens="4",
                    vericache_schedule="lockstep", kv_recent_window=8)
    assert [r.output_ids for r in vc] == [r.output_ids for r in full_out]
    assert [r.output_token_logprobs for r in vc] == [r.output_token_logprobs for r in full_out]
    assert sched.metrics.spec_rounds_total > 0
    prompts = [c for c, n in counts if n >= 40]  # the prompts' segments (52 and 41 pages): a pyramid
    assert len(prompts) == 2 and all(c[0] > c[1] > c[-1] for c in prompts)


@pytest.mark.parametrize("name", ["knorm", "streamingllm", "h2o", "expected_attention", "kvzip_proxy"])
def test_every_dropper_keeps_n_times_k_over_a_segment(name):
    comp = get_compressor(name, config(name, ratio=4, keep_recent=0))  # each method's rule alone
    g = torch.Generator().manual_seed(3)
    pages = 3
    s = pages * T
    k, v = torch.randn(s, H_KV, D, generator=g), torch.randn(s, H_KV, D, generator=g)
    q = torch.randn(s + 2, H_Q, D, generator=g)  # the segment's own queries and two after it
    chunks = comp.compress_segment(0, k, v, q=q, q_positions=torch.arange(s + 2), positions=torch.arange(s))
    assert chunks.matches(comp.layout(0)) and chunks["idx"].shape[0] == pages
    idx = chunks["idx"].permute(2, 0, 1).flatten(1)  # [H, n * k_l]
    assert all(len(set(row.tolist())) == pages * comp.rows(0) for row in idx)
    if name == "knorm":  # lowest key norms over the whole segment
        want = top_k_indices(-k.norm(dim=-1).T, pages * comp.rows(0))
        assert idx.tolist() == want.tolist()
    if name == "streamingllm":  # the 4 sinks, then the segment's most recent tokens
        assert idx[0].tolist() == [0, 1, 2, 3] + list(range(s - 2, s))


def random_segment(pages: int = 4, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    s = pages * T
    k, v = torch.randn(s, H_KV, D, generator=g), torch.randn(s, H_KV, D, generator=g)
    q = torch.randn(s + 2, H_Q, D, generator=g)  # the segment's own queries and two after it
    return k, v, q, torch.arange(s + 2), torch.arange(s)


RANKED = ["knorm", "expected_attention", "kvzip_proxy", "knorm+int8"]


@pytest.mark.parametrize("name", RANKED)
@pytest.mark.parametrize("keep_recent, protected", [(3, 3), (100, 6)])  # at most half of 16 less 4 sinks
def test_a_ranked_dropper_keeps_a_segments_last_tokens_then_its_top_scores(name, keep_recent, protected):
    k, v, q, q_pos, pos = random_segment()
    s = k.shape[0]
    comp = get_compressor(name, config(name, ratio=2, keep_recent=keep_recent))
    drop = comp.drop if "+" in name else comp
    kept = drop.kept(0, k)
    assert kept == 16 and drop.protected(0, kept) == protected
    scores = drop.segment_scores(0, k, v, q, q_pos, pos)  # the sinks (positions 0-3) at +inf
    top = top_k_indices(scores[:, : s - protected], kept - protected)
    want = torch.cat([top, torch.arange(s - protected, s).expand(H_KV, -1)], dim=1)
    got = drop.keep_segment(0, k, v, q, q_pos, pos)
    assert got.tolist() == want.tolist()
    assert got.tolist() != top_k_indices(scores, kept).tolist()  # the score alone keeps others
    assert drop.segment_keep(0, k, v, q, q_pos, pos).tolist() == top_k_indices(scores, kept).tolist()
    if "+" not in name:  # stored: the same rows, dealt out k_l per chunk
        assert comp.compress_segment(0, k, v, q, q_pos, pos)["idx"].permute(2, 0, 1).flatten(1).tolist() == want.tolist()
    unprotected = get_compressor(name, config(name, ratio=2, keep_recent=0))
    assert (unprotected.drop if "+" in name else unprotected).keep_segment(0, k, v, q, q_pos, pos).tolist() == \
        top_k_indices(scores, kept).tolist()


@pytest.mark.parametrize("name", ["expected_attention", "knorm"])
def test_head_adaptive_budgets_keep_every_heads_last_tokens(name):
    k, v, q, q_pos, pos = random_segment()
    s = k.shape[0]
    comp = get_compressor(name, config(name, ratio=4, keep_recent=3, head_budget="adaptive"))  # 2 protected
    chunks = comp.compress_segment(0, k, v, q, q_pos, pos)
    cells = set(zip(chunks["idx"].flatten().tolist(), chunks["head"].flatten().tolist()))
    assert len(cells) == H_KV * comp.kept(0, k)
    assert {(t, h) for t in range(s - 2, s) for h in range(H_KV)} <= cells


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "h2o", "streamingllm", "snapkv+int8"])
def test_a_method_with_a_recent_rule_of_its_own_ignores_keep_recent(name):
    k, v, q, q_pos, pos = random_segment()
    comps = [get_compressor(name, config(name, ratio=4, keep_recent=r)) for r in (0, 4)]
    drops = [c.drop if "+" in name else c for c in comps]
    assert drops[1].protected(0, drops[1].kept(0, k)) == 0
    a, b = (d.keep_segment(0, k, v, q, q_pos, pos) for d in drops)
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize("name, own", [("kvzap", 128), ("knorm", 64), ("expected_attention", 64), ("kvzip", 64),
                                       ("kvzip_proxy", 64), ("snapkv", 0), ("h2o", 0), ("knorm+int8", 64)])
def test_keep_recent_defaults_to_the_methods_own_window(name, own):
    # kvzap: DMS's sliding window of 128 (kvpress DMSPress), beside which its paper runs it; the others 64
    drop = lambda c: c.drop if "+" in name else c  # noqa: E731
    assert drop(get_compressor(name, config(name, ratio=4))).keep_recent == own
    assert drop(get_compressor(name, config(name, ratio=4, keep_recent=32))).keep_recent == (32 if own else 0)


SLIDING_CASES = [(n, "uniform") for n in ("snapkv", "h2o", "knorm", "expected_attention", "streamingllm",
                                           "snapkv+int8")] + [(n, "adaptive") for n in ("snapkv", "h2o",
                                                                                        "expected_attention")]


@pytest.mark.parametrize("name, head_budget", SLIDING_CASES)
def test_a_sliding_window_layer_keeps_its_most_recent_tokens(name, head_budget):
    # Layer 0 reads a sliding window (Gemma 3's sliding layers): whatever the method, it keeps the
    # segment's (and a page's) last k tokens, the only ones its window reads again; layer 1 ranks.
    comp = get_compressor(name, config(name, ratio=4, layers=2, sliding_layers=(0,), head_budget=head_budget,
                                       keep_recent=0))  # layer 1: the method's rule alone
    hot = {0: [3, 17, 18, 30], 1: [0, 1, 2, 25]}
    k, v, q, q_pos, pos = spiky_segment(hot, queries=4)
    drop = comp.drop if name == "snapkv+int8" else comp
    s, kept = k.shape[0], drop.kept(0, k)
    recent = list(range(s - kept, s))
    assert drop.keep_segment(0, k, v, q, q_pos, pos).tolist() == [recent] * H_KV
    assert drop.keep_segment(1, k, v, q, q_pos, pos).tolist() == drop.segment_keep(1, k, v, q, q_pos, pos).tolist()
    chunks = comp.compress_segment(0, k, v, q=q, q_positions=q_pos, positions=pos)
    assert chunks.matches(comp.layout(0))
    if name != "snapkv+int8":  # (the composition stores its quantizer's layout: no idx)
        assert chunks["idx"].permute(2, 0, 1).flatten(1).tolist() == [recent] * H_KV
        if head_budget == "adaptive":  # each head's cells are its own
            assert chunks["head"].tolist() == [[[0, 1]] * drop.rows(0)] * (s // T)
        page = comp.compress(0, k[:T], v[:T], q=q, positions=pos[:T])
        assert page["idx"].T.tolist() == [list(range(T - comp.rows(0), T))] * H_KV


def test_drop_then_quantize_quantizes_the_globally_kept_rows():
    comp = get_compressor("snapkv+int8", config("snapkv+int8", kernel_size=1))
    quant = comp.stage(0)
    hot = {0: [3, 17, 18, 30], 1: [0, 1, 2, 25]}
    k, v, q, q_pos, pos = spiky_segment(hot)
    chunks = comp.compress_segment(0, k, v, q=q, q_positions=q_pos, positions=pos)
    kept = torch.tensor([hot[0], hot[1]]).T[:, None, :]  # [n, 1, H]
    gk = torch.stack([k[kept[..., h], h] for h in range(H_KV)], dim=-2)
    gv = torch.stack([v[kept[..., h], h] for h in range(H_KV)], dim=-2)
    want = quant.compress(0, gk, gv, positions=pos[kept])
    assert chunks.tensors.keys() == want.tensors.keys()
    assert all(torch.equal(chunks[n], want[n]) for n in want.tensors)


# ---------------------------------------------------------------- the scheduler

PROMPT_LENS = [40, 71, 9, 33]
NEW = 24


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


def run(path, dtype, prompt_lens=PROMPT_LENS, **server):
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(3, 400, (n,), generator=g).tolist() for n in prompt_lens]
    sched = Scheduler(ServerArgs(model_path=path, dtype=dtype, skip_tokenizer_init=True, page_size=8,
                                 enable_deterministic_inference=True, **server))
    reqs = [make_request(f"r{i}", ids, max_new_tokens=NEW, ignore_eos=True, temperature=0.0, return_logprob=True)
            for i, ids in enumerate(batch)]
    res = run_to_completion(sched, reqs)
    return [res[f"r{i}"] for i in range(len(batch))], sched


@pytest.fixture(scope="module")
def full(llama):
    return {dtype: run(llama, dtype)[0] for dtype in ("bfloat16", "float32")}


def test_generated_tokens_fold_past_the_recent_window(llama, monkeypatch):
    """Pages of 8, recent window 8: the prompt's whole pages fold when its prefill completes; then
    the tail grows to 16 tokens and its older whole pages fold, leaving 8 to 15 exact."""
    from sglang_vericache.mem_cache.two_tier import TwoTierKV

    seen, fold = [], TwoTierKV.fold

    def spy(self, req, prefilling=False):
        ok = fold(self, req, prefilling)
        seen.append((req.rid, len(req.origin_input_ids), req.kv_committed_len, len(req.comp_indices), not prefilling))
        return ok

    monkeypatch.setattr(TwoTierKV, "fold", spy)
    _, sched = run(llama, "float32", kv_compressor="snapkv", speculative_algorithm="VERICACHE",
                   speculative_num_draft_tokens="4", vericache_schedule="lockstep", kv_recent_window=8)
    assert sched.two_tier.segment_scope and not sched.tree_cache.share_comp
    folded_prompt = {}
    for rid, prompt, committed, comp, done in seen:
        if not done:
            assert comp == 0  # nothing folds while the prompt's prefill is under way
            continue
        folded_prompt.setdefault(rid, (committed, comp))
        assert comp >= prompt // 8  # the prompt's whole pages, folded at once
        tail = committed - comp * 8
        assert tail < 16 and (comp == prompt // 8 or tail >= 8)
    assert {rid: c for rid, (_, c) in folded_prompt.items()} == {f"r{i}": n // 8 for i, n in enumerate(PROMPT_LENS)}
    last = {rid: (committed, comp) for rid, _, committed, comp, _ in seen}
    assert max(comp - n // 8 for (_, comp), n in zip(last.values(), PROMPT_LENS)) >= 2  # generated pages folded
    assert sched.two_tier.pool.available_chunks() == sched.two_tier.pool.num_chunks  # all freed at the end


CASES = [("snapkv", s) for s in ("lockstep", "staggered", "adaptive")] + [
    (c, "lockstep") for c in ("h2o", "expected_attention", "pyramidkv", "knorm", "streamingllm", "kvzip_proxy",
                              "snapkv+kivi4")]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("compressor,schedule", CASES)
def test_segment_scope_output_equals_deterministic_full_mode(llama, full, compressor, schedule, dtype):
    vc, sched = run(llama, dtype, kv_compressor=compressor, kv_compression_ratio=4, speculative_algorithm="VERICACHE",
                    speculative_num_draft_tokens="4", vericache_schedule=schedule, kv_recent_window=8)
    assert sched.two_tier.segment_scope
    # the methods that rank by a score alone keep a segment's last tokens first (--kv-keep-recent, 64)
    assert sched.two_tier.keep_recent == (64 if compressor in ("expected_attention", "knorm", "kvzip_proxy") else 0)
    assert [r.output_ids for r in vc] == [r.output_ids for r in full[dtype]]
    assert [r.output_token_logprobs for r in vc] == [r.output_token_logprobs for r in full[dtype]]
    if schedule == "lockstep":
        assert sched.metrics.spec_rounds_total > 0


def test_prefix_hit_reuses_exact_pages_and_recompresses_the_prompt(llama):
    """A second pass of the same prompts hits the exact tier page by page; no compressed chunk is
    shared (each prompt is compressed whole, with its own last queries) and none leaks."""
    g = torch.Generator().manual_seed(6)
    shared = torch.randint(3, 400, (33,), generator=g).tolist()
    batch = [shared + torch.randint(3, 400, (n,), generator=g).tolist() for n in (12, 30)]
    sched = Scheduler(ServerArgs(model_path=llama, dtype="float32", skip_tokenizer_init=True, page_size=8,
                                 kv_compressor="snapkv", speculative_algorithm="VERICACHE",
                                 speculative_num_draft_tokens="4", vericache_schedule="lockstep"))
    outs = {}
    for tag in ("a", "b"):
        reqs = [make_request(f"{tag}{i}", ids, max_new_tokens=8, temperature=0.0, ignore_eos=True)
                for i, ids in enumerate(batch)]
        res = run_to_completion(sched, reqs)
        outs[tag] = [res[f"{tag}{i}"].output_ids for i in range(len(batch))]
    assert outs["a"] == outs["b"]
    assert [res[f"b{i}"].cached_tokens for i in range(len(batch))] == [(len(p) - 1) // 8 * 8 for p in batch]
    assert sched.tree_cache.comp_hit_rate() == 0 and sched.tree_cache.comp_total_chunks() == 0
    assert sched.two_tier.pool.available_chunks() == sched.two_tier.pool.num_chunks
