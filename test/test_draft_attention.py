"""DRAFT_DECODE attention (drafting over the compressed tier; lossy mode) on the torch backend.

A request's draft context is [compressed chunks | exact tail | draft rows]. With a token-drop
compressor at ratio 1 (every token kept) that context holds exactly the full KV, so DRAFT_DECODE
logits must equal exact EXTEND logits of the same tokens: this pins the context assembly,
positions, masking and where the new K/V are written. Quantizers at their real ratios must stay
close to exact. Tiny random llama checkpoint (GQA: 4 query heads, 2 KV heads), float32, page 4.
"""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.model_executor.forward_batch import DraftContext, ForwardMode
from sglang_vericache.model_executor.model_runner import ModelRunner
from sglang_vericache.server_args import ServerArgs, bundled_model_path
from sglang_vericache.testing import make_random_checkpoint
from sglang_vericache.testing.draft_batches import (
    DraftPool,
    compress_prefix,
    make_compressed_pool,
    prepare_draft_batch,
)
from sglang_vericache.testing.forward_batches import greedy_generate, new_req, prepare_forward_batch

PAGE = 4
# Float32 noise floor on this checkpoint: exact EXTEND vs exact DECODE of the same tokens differ
# by up to 1.5e-5 in the logits (SDPA's reduction order depends on the padded KV length), and
# DRAFT_DECODE at ratio 1 vs EXTEND by up to 4e-5. One context row missing moves them by > 1e-2.
EXACT_ATOL = 1e-4
WRONG_CONTEXT_GAP = 1e-2
# (compressed pages C, committed tokens n, previous draft steps j); exact tails n-1-4C = 5, 2, 0
MIX = [(0, 6, 4), (1, 7, 0), (3, 13, 1)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("ckpt") / "llama"))


def make_runner(path: str, dtype: str = "float32") -> ModelRunner:
    args = dict(dtype=dtype, page_size=PAGE, max_total_tokens=4096, max_running_requests=40)
    return ModelRunner(ServerArgs(model_path=path, **args))


@pytest.fixture(scope="module")
def runner(checkpoint) -> ModelRunner:
    return make_runner(checkpoint)


@pytest.fixture(scope="module")
def calm_runner(checkpoint) -> ModelRunner:
    """The random checkpoint's attention is very sharp (scores q.k/sqrt(d) of +-16), so any KV
    perturbation flips its argmaxes; W_q scaled by 1/4 gives a trained model's softer attention."""
    r = make_runner(checkpoint)
    with torch.no_grad():
        for layer in r.model.model.layers:
            attn = layer.self_attn
            attn.qkv_proj.weight[: attn.q_size].mul_(0.25)
    if r.batch_invariant_mode is not None:  # the deterministic kernel reads its own packed copy of the weights
        from sglang_vericache.layers.batch_invariant import pack_linear_layers

        pack_linear_layers(r.model)
    return r


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def exact_last_logits(runner, seqs: list[list[int]]) -> tuple[torch.Tensor, list]:
    """EXTEND each full sequence in fresh requests -> (last-row logits [B, V], the DriverReqs)."""
    reqs = [new_req(runner) for _ in seqs]
    return runner.forward(prepare_forward_batch(runner, reqs, seqs)), reqs


def prefill(runner, seqs: list[list[int]]) -> list:
    reqs = [new_req(runner) for _ in seqs]
    runner.forward(prepare_forward_batch(runner, reqs, seqs))
    return reqs


def release(runner, reqs) -> None:
    """Give the test's requests back (the module shares one runner)."""
    for r in reqs:
        slots = runner.req_to_token_pool.req_to_token[r.pool_idx, : -(-r.kv_len // PAGE) * PAGE]
        runner.token_to_kv_pool_allocator.free(slots)
        runner.req_to_token_pool.free(r.pool_idx)


def copy_exact_to_draft(runner, draft: DraftPool, src_slots: torch.Tensor) -> list[int]:
    """Previous draft steps' K/V, taken from an exact run of the same tokens."""
    dst = [draft.alloc() for _ in range(len(src_slots))]
    exact = runner.token_to_kv_pool
    for layer in range(exact.num_layers):
        draft.kv.set_kv_buffer(
            layer, torch.tensor(dst, dtype=torch.int64),
            exact.get_key_buffer(layer)[src_slots], exact.get_value_buffer(layer)[src_slots],
        )
    return dst


# ------------------------------------------------------------------ exactness at ratio 1


@pytest.mark.parametrize("compressor", ["streamingllm", "knorm"])
def test_ratio1_draft_step_equals_exact_logits_for_a_mixed_batch(runner, compressor):
    """Batch of 3: C = 0/1/3 compressed pages, tails 5/2/0, 4/0/1 previous drafts."""
    seqs = [tokens(n + j, seed=i) for i, (c, n, j) in enumerate(MIX)]
    ref, ref_reqs = exact_last_logits(runner, seqs)
    cpool = make_compressed_pool(runner, compressor, ratio=1, num_chunks=8)
    assert cpool.layouts[0].kind == "token_drop" and cpool.layouts[0].rows == PAGE  # keeps every token
    draft = DraftPool(runner, num_slots=16)
    drafts = prefill(runner, [s[: n - 1] for s, (c, n, j) in zip(seqs, MIX)])
    dreqs = []
    for req, ref_req, (c, n, j) in zip(drafts, ref_reqs, MIX):
        d = compress_prefix(runner, cpool, req, c)
        src = runner.req_to_token_pool.req_to_token[ref_req.pool_idx, n - 1 : n - 1 + j]
        d.draft_slots = copy_exact_to_draft(runner, draft, src)
        dreqs.append(d)
    fb = prepare_draft_batch(runner, cpool, dreqs, [s[-1] for s in seqs], draft)
    assert fb.draft_ctx.tail_lens == [5, 2, 0] and fb.positions.tolist() == [9, 6, 13]
    exact_before = [k.clone() for k in runner.token_to_kv_pool.k_buffer]
    logits = runner.forward(fb)
    # the exact pool is untouched: the new K/V go to the draft pool only
    assert all(torch.equal(a, b) for a, b in zip(exact_before, runner.token_to_kv_pool.k_buffer))
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() < EXACT_ATOL
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    # the new token's K/V went to its draft slot, and equal the exact run's K/V of that position
    exact = runner.token_to_kv_pool
    for layer in range(exact.num_layers):
        for d, ref_req, (c, n, j) in zip(dreqs, ref_reqs, MIX):
            ref_slot = runner.req_to_token_pool.req_to_token[ref_req.pool_idx, n - 1 + j]
            got = draft.kv.get_key_buffer(layer)[d.draft_slots[-1]]
            assert (got - exact.get_key_buffer(layer)[ref_slot]).abs().max().item() < EXACT_ATOL
    # the tolerance separates: one tail row fewer for request 1 is far outside it
    fb.draft_ctx.tail_lens[1] -= 1
    wrong = runner.forward(fb)
    assert (wrong[1] - ref[1]).abs().max().item() > WRONG_CONTEXT_GAP
    release(runner, ref_reqs + drafts)


def test_ratio1_lossy_step_writes_the_exact_tail_and_equals_exact_logits(runner):
    """Lossy mode: no draft pool; the new token's K/V go to its exact tail slot."""
    seqs = [tokens(n, seed=10 + i) for i, (c, n, j) in enumerate(MIX)]
    ref, ref_reqs = exact_last_logits(runner, seqs)
    cpool = make_compressed_pool(runner, "streamingllm", ratio=1, num_chunks=8)
    reqs = prefill(runner, [s[:-1] for s in seqs])
    dreqs = [compress_prefix(runner, cpool, r, c) for r, (c, n, j) in zip(reqs, MIX)]
    fb = prepare_draft_batch(runner, cpool, dreqs, [s[-1] for s in seqs], draft_pool=None)
    assert fb.draft_ctx.new_kv == "exact" and fb.draft_ctx.tail_lens == [6, 3, 1]
    logits = runner.forward(fb)
    assert (logits - ref).abs().max().item() < EXACT_ATOL
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    exact = runner.token_to_kv_pool
    for layer in range(exact.num_layers):
        k = exact.get_key_buffer(layer)
        r2t = runner.req_to_token_pool.req_to_token
        want = k[[int(r2t[r.pool_idx, len(s) - 1]) for r, s in zip(ref_reqs, seqs)]]
        assert (k[fb.out_cache_loc] - want).abs().max().item() < EXACT_ATOL
    release(runner, ref_reqs + reqs)


def test_ratio1_draft_steps_in_a_row_equal_exact_greedy_decoding(runner):
    """Feed t_n, then each step's argmax, 6 steps: the drafts are the exact greedy continuation."""
    steps = 6
    prompts = [tokens(n, seed=20 + i) for i, (c, n, j) in enumerate(MIX)]
    want = greedy_generate(runner, prompts, steps)
    cpool = make_compressed_pool(runner, "streamingllm", ratio=1, num_chunks=8)
    draft = DraftPool(runner, num_slots=32)
    reqs = prefill(runner, [p[:-1] for p in prompts])
    dreqs = [compress_prefix(runner, cpool, r, c) for r, (c, n, j) in zip(reqs, MIX)]
    next_ids, got = [p[-1] for p in prompts], [[] for _ in prompts]
    for _ in range(steps):
        logits = runner.forward(prepare_draft_batch(runner, cpool, dreqs, next_ids, draft))
        next_ids = logits.argmax(-1).tolist()
        for out, t in zip(got, next_ids):
            out.append(t)
    assert got == want
    assert [len(d.draft_slots) for d in dreqs] == [steps] * 3
    release(runner, reqs)


# ------------------------------------------------------------------ quantized chunks


# 12 requests (n committed tokens, previous drafts); every whole page of n-1 is compressed
QUANT_LENS = [(25 + 3 * i, i % 3) for i in range(12)]
# max |logit - exact| measured on calm_runner and this batch (logit std ~4): int8 0.26, kivi4 1.63
QUANT_BOUNDS = {"int8": 0.5, "kivi4": 3.0}


def quantized_draft_step(runner, compressor: str):
    """-> (DRAFT_DECODE logits, exact logits, logits of exact DECODE over the dequantized KV)."""
    seqs = [tokens(n + j, seed=30 + i) for i, (n, j) in enumerate(QUANT_LENS)]
    ref, ref_reqs = exact_last_logits(runner, seqs)
    cpool = make_compressed_pool(runner, compressor, ratio=4, num_chunks=160, group_size=4)
    assert cpool.layouts[0].kind == "quantized"
    draft = DraftPool(runner, num_slots=64)
    reqs = prefill(runner, [s[: n - 1] for s, (n, j) in zip(seqs, QUANT_LENS)])
    dreqs = []
    for req, ref_req, (n, j) in zip(reqs, ref_reqs, QUANT_LENS):
        d = compress_prefix(runner, cpool, req, (n - 1) // PAGE)
        src = runner.req_to_token_pool.req_to_token[ref_req.pool_idx, n - 1 : n - 1 + j]
        d.draft_slots = copy_exact_to_draft(runner, draft, src)
        dreqs.append(d)
    logits = runner.forward(prepare_draft_batch(runner, cpool, dreqs, [s[-1] for s in seqs], draft))
    # reference: exact DECODE of the same tokens, the compressed pages' KV replaced by their dequantized rows
    deq_reqs = prefill(runner, [s[:-1] for s in seqs])
    exact = runner.token_to_kv_pool
    for req, d in zip(deq_reqs, dreqs):
        slots = runner.req_to_token_pool.req_to_token[req.pool_idx, : len(d.comp_ids) * PAGE]
        for layer in range(exact.num_layers):
            exact.set_kv_buffer(layer, slots, *cpool.decompress(layer, d.comp_ids))
    deq = runner.forward(prepare_forward_batch(runner, deq_reqs, [[s[-1]] for s in seqs], ForwardMode.DECODE))
    release(runner, ref_reqs + reqs + deq_reqs)
    return logits, ref, deq


@pytest.mark.parametrize("compressor", ["int8", "kivi4", "kivi2"])
def test_quantized_draft_step_equals_exact_decode_over_the_dequantized_kv(runner, compressor):
    logits, _, deq = quantized_draft_step(runner, compressor)
    assert (logits - deq).abs().max().item() < EXACT_ATOL


def test_bfloat16_model_reads_float32_dequantized_rows_like_its_own_pool(checkpoint):
    """bf16 runner, the torch path: dequantized rows are cast to bf16 in the context, as the exact pool
    stores them. The two paths pad the context differently, and bf16 attention's accumulation order
    depends on the padded length and the thread count (measured 0 at 2 threads, 3 ulps at 1): allowed
    4 bf16 ulps at |logit| < 16. (The fused kernel reads the rows in float32: the test below.)"""
    runner = make_runner(checkpoint, "bfloat16")
    runner.attn_backend.fused_draft = False
    try:
        logits, _, deq = quantized_draft_step(runner, "int8")
    finally:
        runner.attn_backend.fused_draft = None
    assert logits.dtype == torch.float32
    assert (logits - deq).abs().max().item() <= 4 * 2**-4


@pytest.mark.parametrize("compressor", ["int8", "kivi4"])
def test_quantized_logits_stay_within_a_bound_of_exact_and_keep_the_argmax(calm_runner, compressor):
    logits, ref, _ = quantized_draft_step(calm_runner, compressor)
    err = (logits - ref).abs().max(-1).values
    print(f"{compressor}: max |logit - exact| per request {[round(e, 3) for e in err.tolist()]}")
    assert err.min().item() > 0 and err.max().item() < QUANT_BOUNDS[compressor]  # lossy, boundedly
    # An error under half the exact top-2 margin cannot flip the argmax; near-ties may flip and
    # are reported, not hidden.
    top2 = ref.topk(2, dim=-1).values
    safe = (top2[:, 0] - top2[:, 1]) > 2 * err
    print(f"{compressor}: {int((~safe).sum())} near-tie request(s) of {len(safe)}")
    assert safe.any()  # the claim is tested on at least one request
    assert torch.equal(logits.argmax(-1)[safe], ref.argmax(-1)[safe])


def test_shared_quantized_chunks_give_the_same_logits_as_private_copies(runner):
    """Two requests on one prefix: sharing its chunk ids (dequantized once) changes nothing."""
    prefix = tokens(16, seed=40)
    seqs = [prefix + [7, 8, 9], prefix + [11, 12]]
    cpool = make_compressed_pool(runner, "kivi4", ratio=4, num_chunks=160, group_size=4)
    results = []
    for share in (False, True):
        reqs = prefill(runner, [s[:-1] for s in seqs])
        a = compress_prefix(runner, cpool, reqs[0], 4)
        b = compress_prefix(runner, cpool, reqs[1], 0 if share else 4)
        if share:
            b.comp_ids = a.comp_ids
        fb = prepare_draft_batch(runner, cpool, [a, b], [s[-1] for s in seqs], draft_pool=None)
        results.append(runner.forward(fb))
        release(runner, reqs)
    assert (results[0] - results[1]).abs().max().item() < 1e-6


# ------------------------------------------------------------------ the fused CPU kernel


def draft_batch(runner, compressor: str):
    """QUANT_LENS's requests, every whole page compressed, j previous drafts each -> (DRAFT_DECODE batch, reqs)."""
    seqs = [tokens(n + j, seed=60 + i) for i, (n, j) in enumerate(QUANT_LENS)]
    cpool = make_compressed_pool(runner, compressor, ratio=3, num_chunks=160, group_size=4)
    draft = DraftPool(runner, num_slots=64)
    reqs = prefill(runner, [s[: n - 1 + j] for s, (n, j) in zip(seqs, QUANT_LENS)])
    gen = torch.Generator().manual_seed(0)
    dreqs = []
    for req, (n, j) in zip(reqs, QUANT_LENS):
        req.kv_len = n - 1  # the last j positions become previous drafts
        d = compress_prefix(runner, cpool, req, (n - 1) // PAGE, random_queries=gen)
        d.draft_slots = copy_exact_to_draft(
            runner, draft, runner.req_to_token_pool.req_to_token[req.pool_idx, n - 1 : n - 1 + j])
        dreqs.append(d)
    return prepare_draft_batch(runner, cpool, dreqs, [s[-1] for s in seqs], draft), reqs


def both_paths(runner, run):
    """run() through the fused kernel, then through the torch path."""
    backend = runner.attn_backend
    try:
        backend.fused_draft = True
        fused = run()
        backend.fused_draft = False
        return fused, run()
    finally:
        backend.fused_draft = None


@pytest.mark.parametrize("compressor", ["streamingllm", "pyramidkv", "h2o", "int8", "kivi2", "kivi4", "fp8",
                                        "kvquant3", "rotatekv2", "snapkv+rotatekv4"])
def test_fused_kernel_gives_the_torch_paths_draft_logits(runner, compressor, monkeypatch):
    """Per-layer row counts (pyramidkv), value groups narrower than a vector (group 4), previous drafts;
    kvquant / rotatekv (pre-RoPE keys) and a composition with per-head positions. Every layer reads
    the kernel (none falls back to the torch path)."""
    import sgl_kernel_ext.cpu_draft_attention as cda

    from sglang_vericache.layers.attention.draft_kernel import fused_draft_available

    assert fused_draft_available(), "the fused CPU draft kernel did not build"
    calls, kernel = [], cda.draft_decode_attention
    monkeypatch.setattr(cda, "draft_decode_attention", lambda *a: calls.append(1) or kernel(*a))
    fb, reqs = draft_batch(runner, compressor)
    fused, torch_path = both_paths(runner, lambda: runner.forward(fb))
    release(runner, reqs)
    assert len(calls) == runner.model_config.num_hidden_layers
    assert (fused - torch_path).abs().max().item() < EXACT_ATOL
    assert torch.equal(fused.argmax(-1), torch_path.argmax(-1))


@pytest.mark.parametrize("compressor", ["kvquant4", "rotatekv4", "kivi4"])
def test_fused_kernel_scores_keys_from_codes_in_the_bundled_model(compressor):
    """The bundled model (head dim 64, two KV heads of two query heads each) with pages of 16: chunks of whole
    16-row blocks at consecutive positions, which the kernel scores from their codes under AVX-512
    (kvquant_key_scores / rotatekv_key_scores / kivi_key_scores; elsewhere its row path): the draft logits of a
    mixed batch (1-4 compressed pages, tails, previous drafts) as the torch path's, the same argmax."""
    page = 16
    runner = ModelRunner(ServerArgs(model_path=bundled_model_path(), dtype="float32", page_size=page,
                                    max_total_tokens=2048, max_running_requests=8))
    lens = [(40, 2), (17, 0), (70, 1)]  # (committed tokens, previous drafts)
    seqs = [tokens(n + j, seed=90 + i) for i, (n, j) in enumerate(lens)]
    cpool = make_compressed_pool(runner, compressor, ratio=3, num_chunks=40, group_size=32)
    draft = DraftPool(runner, num_slots=16)
    reqs = prefill(runner, [s[: n - 1 + j] for s, (n, j) in zip(seqs, lens)])
    dreqs = []
    for req, (n, j) in zip(reqs, lens):
        req.kv_len = n - 1
        d = compress_prefix(runner, cpool, req, (n - 1) // page, random_queries=torch.Generator().manual_seed(0))
        d.draft_slots = copy_exact_to_draft(runner, draft, runner.req_to_token_pool.req_to_token[req.pool_idx, n - 1 : n - 1 + j])
        dreqs.append(d)
    fb = prepare_draft_batch(runner, cpool, dreqs, [s[-1] for s in seqs], draft)
    fused, torch_path = both_paths(runner, lambda: runner.forward(fb))
    assert (fused - torch_path).abs().max().item() < EXACT_ATOL
    assert torch.equal(fused.argmax(-1), torch_path.argmax(-1))


def test_without_the_kernel_drafting_takes_the_torch_path_with_a_warning(runner, monkeypatch, caplog):
    """A kernel that cannot be built (no compiler): one warning, then every draft layer on the torch path."""
    import sgl_kernel_ext.cpu_draft_attention as cda

    from sglang_vericache.layers.attention import draft_kernel, torch_attend

    def no_compiler():
        raise RuntimeError("could not build the CPU kernel draft_decode_attention.cpp: g++ not found")

    monkeypatch.delitem(torch_attend._loaded, "cpu_draft_attention", raising=False)  # tried again
    monkeypatch.setattr(cda, "load", no_compiler)
    monkeypatch.setattr(cda, "draft_decode_attention", None)  # calling the kernel would fail loudly
    fb, reqs = draft_batch(runner, "kivi4")
    backend = runner.attn_backend
    with caplog.at_level("WARNING", logger=draft_kernel.__name__):
        backend.fused_draft = None  # decided again at this forward
        logits = runner.forward(fb)
    assert backend.fused_draft is False
    assert "fused CPU kernel is unavailable" in caplog.text and "g++ not found" in caplog.text
    backend.fused_draft = False
    assert torch.equal(logits, runner.forward(fb))  # the torch path's logits
    backend.fused_draft = None
    release(runner, reqs)


@pytest.mark.parametrize("compressor", ["knorm", "kivi4"])
def test_fused_kernel_in_bfloat16_reads_dequantized_rows_in_float32(checkpoint, compressor, monkeypatch):
    """bf16 attention of one layer, same q / k / v: the kernel reads dequantized rows in float32 (the
    compressor's own values, not rounded to the model's dtype as the torch path's context holds them);
    its output is that attention cast to bf16. Asked to round the rows to bf16, the same call gives the
    torch path's output up to the torch path's bf16 arithmetic (within 2 bf16 ulps of the output)."""
    import sgl_kernel_ext.cpu_draft_attention as cda

    calls, kernel = [], cda.draft_decode_attention
    monkeypatch.setattr(cda, "draft_decode_attention", lambda *a: calls.append(a) or kernel(*a))
    runner = make_runner(checkpoint, "bfloat16")
    fb, reqs = draft_batch(runner, compressor)
    fb.req_to_token_pool, fb.token_to_kv_pool = runner.req_to_token_pool, runner.token_to_kv_pool
    backend, attn = runner.attn_backend, runner.model.model.layers[1].self_attn.attn
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(fb.batch_size, n * attn.head_dim, generator=gen).to(torch.bfloat16)
               for n in (attn.num_heads, attn.num_kv_heads, attn.num_kv_heads))
    backend.init_forward_metadata(fb)
    fused, torch_path = both_paths(runner, lambda: backend.forward(q, k, v, attn, fb))
    (args,) = calls
    assert args[-1] is torch.float32  # round_to
    as_pool = kernel(*args[:-1], torch.bfloat16).to(torch.bfloat16).reshape(fused.shape)
    again = kernel(*args).to(torch.bfloat16).reshape(fused.shape)
    release(runner, reqs)
    assert fused.dtype == torch.bfloat16
    assert torch.equal(fused, again)
    if compressor != "knorm":  # token-dropped rows are the pool's own: never rounded, the same either way
        assert not torch.equal(fused, as_pool)
    torch.testing.assert_close(as_pool.float(), torch_path.float(), rtol=2**-7, atol=2**-8)


# ------------------------------------------------------------------ contract


def test_draft_decode_is_not_decode():
    assert not ForwardMode.DRAFT_DECODE.is_decode() and not ForwardMode.DRAFT_DECODE.is_extend()
    assert ForwardMode.DRAFT_DECODE.is_draft_decode()


def test_draft_context_rejects_inconsistent_targets(runner):
    cpool = make_compressed_pool(runner, "streamingllm", ratio=1, num_chunks=1)
    ids = [torch.tensor([], dtype=torch.int64)]
    with pytest.raises(ValueError, match="needs draft_pool"):
        DraftContext(cpool, ids, [3])  # new_kv="draft" without a draft pool
    with pytest.raises(ValueError, match="tail includes the new token"):
        DraftContext(cpool, ids, [0], new_kv="exact")


def test_draft_metadata_pads_each_part_and_indexes_rows_per_layout(runner):
    """Index math a fused kernel can reuse: [compressed | tail | draft], padding -> index 0, masked."""
    from sglang_vericache.compress.base import Layout
    from sglang_vericache.layers.attention.draft_metadata import build_draft_metadata

    cpool = make_compressed_pool(runner, "streamingllm", ratio=1, num_chunks=4)
    draft = DraftPool(runner, num_slots=8)
    reqs = prefill(runner, [tokens(9, seed=50), tokens(3, seed=51)])
    a = compress_prefix(runner, cpool, reqs[0], 2)  # chunks [1, 2], tail = position 8
    b = compress_prefix(runner, cpool, reqs[1], 0)  # no chunks, tail = positions 0..2
    b.draft_slots = [draft.alloc()]
    fb = prepare_draft_batch(runner, cpool, [a, b], [5, 6], draft)
    fb.req_to_token_pool = runner.req_to_token_pool
    md = build_draft_metadata(fb)
    r2t = runner.req_to_token_pool.req_to_token
    a_tail, b_tail = int(r2t[reqs[0].pool_idx, 8]), r2t[reqs[1].pool_idx, :3].tolist()
    assert md.tail_index.tolist() == [[a_tail, 0, 0], b_tail]
    assert md.tail_valid.tolist() == [[True, False, False], [True, True, True]]
    new_a, new_b = fb.out_cache_loc.tolist()
    assert md.draft_index.tolist() == [[new_a, 0], [b.draft_slots[0], new_b]]
    assert md.draft_flat.tolist() == md.draft_index.T.flatten().tolist()  # position-major
    two_rows = Layout("token_drop", PAGE, 2, ())
    ci = md.compressed_index(two_rows)
    assert ci.row_index.tolist() == [[2, 3, 4, 5], [0, 1, 0, 1]]  # chunk id * rows + j; padding chunk 0
    assert ci.valid.tolist() == [[True] * 4, [False] * 4]
    assert md.mask(two_rows)[:, 0, 0].tolist() == [[True] * 4 + [True, False, False, True, False],
                                                   [False] * 4 + [True, True, True, True, True]]
    # quantized: distinct chunks dequantized once, rows of request 1 reuse request 0's (a shared prefix)
    b.comp_ids = torch.tensor([2])
    fb.draft_ctx.comp_ids = [a.comp_ids, b.comp_ids]
    ci = build_draft_metadata(fb).compressed_index(Layout("quantized", PAGE, 1, ()))
    assert ci.chunk_ids.tolist() == [1, 2] and ci.row_index.tolist() == [[0, 1], [1, 0]]
    release(runner, reqs)
