"""KVzip's reconstruction pass (compress/kvzip_reconstruction.py): it is the teacher-forced
re-reading of a page after its repeat prompt and leaves nothing behind; the chunks it scores are
a function of the page's prefix (alone or batched, any chunked prefill); and VeriCache over
kvzip's tier gives deterministic full mode's output bitwise in bfloat16, greedy and seeded,
lock-step and staggered, on a prefix hit (every compressor's lock-step case is in
test_deterministic_inference.py). Page scope (each page's own pass) and segment scope (the whole
prompt replayed in chunks, as kvpress does, and ranked whole)."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.compress.kvzip import ReconstructionPass, reconstruction_scores
from sglang_vericache.compress.token_drop import deal, top_k_indices
from sglang_vericache.layers.rotary_embedding import RotaryEmbedding
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.model_config import ModelConfig
from sglang_vericache.compress.kvzip_reconstruction import NO_TOKENIZER_FIRST, NO_TOKENIZER_NEXT
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.forward_batches import new_req, prepare_forward_batch
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

PAGE = 8
NEW = 16
SEEDED = {"temperature": 0.9, "top_p": 0.95, "top_k": 40}
KVZIP = dict(kv_compressor="kvzip", kv_compression_ratio=4, speculative_algorithm="VERICACHE",
             speculative_num_draft_tokens="6", kv_compress_scope="page")
SEGMENT = KVZIP | {"kv_compress_scope": "segment"}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_random_checkpoint("qwen2", str(tmp_path_factory.mktemp("qwen2")))


def scheduler(path, **server) -> Scheduler:
    server.setdefault("vericache_schedule", "lockstep")
    return Scheduler(ServerArgs(model_path=path, dtype="bfloat16", skip_tokenizer_init=True, page_size=PAGE,
                                enable_deterministic_inference=True, **server))


def prompts(lens, seed=0, shared=0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 400, (shared,), generator=g).tolist()
    return [prefix + torch.randint(3, 400, (n,), generator=g).tolist() for n in lens]


def outputs(sched, batch, sampling=None, tag="t"):
    reqs = [make_request(f"{tag}{i}", ids, seed=100 + i, return_logprob=True, max_new_tokens=NEW, ignore_eos=True,
                         **(sampling or {"temperature": 0.0})) for i, ids in enumerate(batch)]
    res = run_to_completion(sched, reqs)
    return [(res[r.rid].output_ids, res[r.rid].output_token_logprobs, res[r.rid].cached_tokens) for r in reqs]


def test_the_pass_is_the_teacher_forced_reread_and_leaves_nothing_behind(qwen2):
    sched = scheduler(qwen2, **KVZIP)
    rec, mr = sched.two_tier.reconstruction, sched.model_runner
    ids = prompts([3 * PAGE])[0]
    req = new_req(mr)
    mr.forward(prepare_forward_batch(mr, [req], [ids]))
    pool, r2t = mr.token_to_kv_pool, mr.req_to_token_pool.req_to_token
    row, free = r2t[req.pool_idx].clone(), mr.token_to_kv_pool_allocator.available_size()
    slots = row[: len(ids)]
    kv = [(pool.get_key_buffer(i)[slots].clone(), pool.get_value_buffer(i)[slots].clone())
          for i in range(pool.num_layers)]
    passes = rec.passes(req.pool_idx, ids, [0, PAGE])
    assert torch.equal(r2t[req.pool_idx], row) and mr.token_to_kv_pool_allocator.available_size() == free
    assert all(torch.equal(pool.get_key_buffer(i)[slots], k) and torch.equal(pool.get_value_buffer(i)[slots], v)
               for i, (k, v) in enumerate(kv))
    assert (rec.forwards, rec.tokens) == (2, len(NO_TOKENIZER_FIRST) + len(NO_TOKENIZER_NEXT) + 8 + 2 * PAGE)
    for start, layers in zip([0, PAGE], passes):
        end = start + PAGE
        rows = (NO_TOKENIZER_FIRST if start == 0 else NO_TOKENIZER_NEXT + ids[:start]) + ids[start:end]
        ref = new_req(mr)  # one prefill of the prefix and the pass's rows (deterministic: chunking-invariant)
        fb = prepare_forward_batch(mr, [ref], [ids[:end] + rows])
        fb.captured_q, fb.captured_k = {}, {}
        mr.forward(fb)
        for layer, p in enumerate(layers):
            assert torch.equal(p.q.flatten(-2), fb.captured_q[layer][end:])
            assert torch.equal(p.k.flatten(-2), fb.captured_k[layer][end:])
            if start == 0:
                assert p.sink_k is None  # page 0 holds the sinks itself
            else:
                assert torch.equal(p.sink_k, pool.get_key_buffer(layer)[slots[:4]])


def chunks_of(sched, rid):
    """Records every chunk the two-tier folds for request rid: {page: tensors of layers 0 and last}."""
    tt, log = sched.two_tier, {}
    fold = tt.fold

    def recording(req, **kw):
        c = len(req.comp_indices)
        ok = fold(req, **kw)
        if req.rid == rid:
            for j, cid in enumerate(req.comp_indices[c:].tolist()):
                log[c + j] = [t.clone() for layer in (0, tt.pool.num_layers - 1)
                              for t in tt.pool.read(layer, torch.tensor([cid])).tensors.values()]
        return ok

    tt.fold = recording
    return log


def test_chunks_depend_on_the_prefix_alone_not_on_batching_or_chunked_prefill(qwen2):
    batch = prompts([45, 12, 70, 29], seed=1)
    alone_s = scheduler(qwen2, **KVZIP)
    alone = chunks_of(alone_s, "t0")
    out_alone = outputs(alone_s, batch[:1])
    crowd_s = scheduler(qwen2, chunked_prefill_size=16, **KVZIP)
    crowd = chunks_of(crowd_s, "t0")
    out_crowd = outputs(crowd_s, batch)
    assert out_alone[0] == out_crowd[0]
    assert sorted(alone) == sorted(crowd) == list(range((45 + NEW - 1) // PAGE))
    assert all(all(torch.equal(a, b) for a, b in zip(alone[p], crowd[p])) for p in alone)
    proxy_s = scheduler(qwen2, **(KVZIP | {"kv_compressor": "kvzip_proxy"}))
    proxy = chunks_of(proxy_s, "t0")
    outputs(proxy_s, batch[:1])
    assert any(not torch.equal(alone[p][2], proxy[p][2]) for p in alone)  # kept indices: the pass matters


@pytest.fixture(scope="module")
def shared_batch():
    return prompts([5, 30, 19], seed=2, shared=3 * PAGE + 3)


@pytest.fixture(scope="module")
def full_runs(qwen2, shared_batch):
    return {s: outputs(scheduler(qwen2), shared_batch, None if s == "greedy" else SEEDED) for s in ("greedy", "seeded")}


@pytest.mark.parametrize("scope", ["page", "segment"])
@pytest.mark.parametrize("schedule, sampling", [("lockstep", "greedy"), ("staggered", "seeded")])
def test_vericache_over_kvzip_equals_deterministic_full_on_a_prefix_hit(qwen2, shared_batch, full_runs, schedule,
                                                                       sampling, scope):
    sched = scheduler(qwen2, **(KVZIP | {"vericache_schedule": schedule, "kv_compress_scope": scope}))
    sched.two_tier.reconstruction.chunk_tokens = min(sched.two_tier.reconstruction.chunk_tokens, 2 * PAGE)
    params = None if sampling == "greedy" else SEEDED
    warm = outputs(sched, shared_batch[:1], params, tag="w")  # caches the shared prefix's pages
    got = outputs(sched, shared_batch, params)
    want = full_runs[sampling]
    assert [(o, lp) for o, lp, _ in got] == [(o, lp) for o, lp, _ in want]
    assert warm[0][:2] == want[0][:2]
    assert all(c >= 3 * PAGE for _, _, c in got)  # every request hit the shared prefix
    assert sched.metrics.spec_rounds_total > 0 and sched.two_tier.reconstruction.forwards > 0


def test_a_page_too_long_for_the_pass_is_refused_by_name(qwen2):
    with pytest.raises(ValueError, match="kvzip: the reconstruction pass of a page of 64 tokens"):
        Scheduler(ServerArgs(model_path=qwen2, dtype="bfloat16", skip_tokenizer_init=True, page_size=64, **KVZIP))


def test_segment_scope_keeps_the_top_k_of_the_whole_prompt_from_its_chunked_replay(qwen2):
    """Segment scope: the prompt's whole pages replayed in chunks of 2 pages (each chunk's pass after
    the segment, over all of it), each chunk's keys scored by its own pass, the top k_l * n per
    head taken over the whole segment and dealt k_l to each chunk in position order; written out
    here from one prefill per chunk (deterministic inference is chunking-invariant). Uniform head
    budgets (kvzip's default ranks across heads: test_head_adaptive.py)."""
    sched = scheduler(qwen2, **SEGMENT, kv_head_budget="uniform")
    tt, mr = sched.two_tier, sched.model_runner
    tt.reconstruction.chunk_tokens = 2 * PAGE
    ids = prompts([45], seed=3)[0]
    log = chunks_of(sched, "t0")
    outputs(sched, [ids])
    end, n = 5 * PAGE, 5  # the prompt's whole pages, folded as one segment when its prefill completes
    assert sorted(log) == list(range(n))
    assert tt.reconstruction.forwards == 3 and tt.fold_pages == n
    comp, pool = tt.compressor, mr.token_to_kv_pool
    layers = (0, pool.num_layers - 1)
    scores = {layer: [] for layer in layers}
    for a in range(0, end, 2 * PAGE):
        b = min(end, a + 2 * PAGE)
        rows = (NO_TOKENIZER_FIRST if a == 0 else NO_TOKENIZER_NEXT + ids[a - 8 : a]) + ids[a:b]
        ref = new_req(mr)
        fb = prepare_forward_batch(mr, [ref], [ids[:end] + rows])
        fb.captured_q, fb.captured_k = {}, {}
        mr.forward(fb)
        slots = mr.req_to_token_pool.req_to_token[ref.pool_idx, :end]
        for layer in layers:
            keys = pool.get_key_buffer(layer)[slots]
            rec = ReconstructionPass(fb.captured_q[layer][end:].unflatten(-1, (-1, pool.head_dim)),
                                     fb.captured_k[layer][end:].unflatten(-1, (-1, pool.head_dim)),
                                     keys[: min(4, a)] if a else None)
            scores[layer].append(reconstruction_scores(rec, keys[a:b], comp.config.scale))
    for j, layer in enumerate(layers):
        s = torch.cat(scores[layer], dim=-1)
        s[:, :4] = float("inf")  # the sinks are kept first, then the segment's last tokens (--kv-keep-recent)
        recent = comp.protected(layer, comp.rows(layer) * n)
        assert recent == 3  # the cap, half of what the sinks leave of 10 (not 64)
        s[:, end - recent :] = float("inf")
        want = deal(top_k_indices(s, comp.rows(layer) * n), n, comp.rows(layer))  # [n, k_l, H]
        got = torch.stack([log[p][3 * j + 2][0] for p in range(n)]).long()
        assert torch.equal(got, want)
    assert any(log[p][2].unique().numel() > 1 for p in range(n))


def test_segment_scope_has_room_for_a_chunks_replay_past_the_context(qwen2):
    """A segment's replay needs room past the context: the runtime keeps it for kvzip over segments."""
    sched = scheduler(qwen2, **SEGMENT)
    rec, mr = sched.two_tier.reconstruction, sched.model_runner
    assert rec.chunk_tokens == 2048 and sched.two_tier.segment_scope
    assert mr.req_to_token_pool.max_context_len - mr.model_config.context_len >= rec.max_rows
    # The replay's scratch slots are not the requests': the limits follow (a prompt that cannot fit is refused).
    assert len(rec.scratch) == rec.max_rows
    assert sched.max_total_num_tokens == mr.max_total_num_tokens - rec.max_rows


def test_a_prompt_near_the_context_length_replays_past_it(qwen2):
    """A segment's replay runs at positions past the model's context (kvzip's repeat prompt and the chunk after
    the segment): the RoPE tables cover them, and the output still equals deterministic full mode's."""
    batch = prompts([qwen2_context(qwen2) - NEW - 8])
    sched = scheduler(qwen2, **SEGMENT)
    mr = sched.model_runner
    reach = mr.model_config.context_len + mr.positions_past_context()
    assert [m.max_position for m in mr.model.modules() if isinstance(m, RotaryEmbedding)] == [reach]
    got = outputs(sched, batch)
    assert [(o, lp) for o, lp, _ in got] == [(o, lp) for o, lp, _ in outputs(scheduler(qwen2), batch)]
    assert sched.two_tier.reconstruction.forwards > 0 and sched.metrics.spec_rounds_total > 0


def qwen2_context(path) -> int:
    return ModelConfig.from_path(path).context_len
