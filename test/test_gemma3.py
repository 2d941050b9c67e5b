"""Gemma 3 (tiny random checkpoint: one KV head, sliding layers of window 12 around a global layer,
local / global RoPE bases) and sliding-window attention in the runtime:

- full mode's greedy tokens equal transformers' Gemma3ForCausalLM (float32 and bfloat16), prompts
  longer than the window, in one batch; final-logit softcapping too; Mistral with a window as well;
- VeriCache (a token dropper and a quantizer, lock-step rounds) equals deterministic full mode bitwise
  in bfloat16, tokens and logprobs, and so do prompts run alone and batched;
- a sliding layer's draft context drops the rows before its window (draft_metadata.windowed_draft).
The CPU kernel's first-visible-key argument: test/kernels/test_fixed_chunk_attention.py.
"""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

WINDOW = 12  # the gemma3 family's sliding_window
PROMPT_LENS = [30, 7, 45, 19]
NEW = 16


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return make_random_checkpoint("gemma3", str(tmp_path_factory.mktemp("gemma3")))


def prompts(lens=PROMPT_LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in lens]


def serve(path, batch, dtype, new=NEW, **server):
    sched = Scheduler(ServerArgs(model_path=path, dtype=dtype, skip_tokenizer_init=True, page_size=4, **server))
    reqs = [make_request(f"r{i}", ids, max_new_tokens=new, ignore_eos=True, temperature=0.0, return_logprob=True)
            for i, ids in enumerate(batch)]
    res = run_to_completion(sched, reqs)
    return [res[f"r{i}"] for i in range(len(batch))], sched


def hf_greedy(path, batch, dtype, new=NEW, gaps=None):
    """transformers' greedy continuations; gaps: a list to receive each step's top-two logit gap."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in batch:
            out = model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
            outs.append(out.sequences[0, len(p):].tolist())
            if gaps is not None:
                gaps.extend(float(top[0] - top[1]) for top in (s[0].topk(2).values for s in out.scores))
    return outs


def test_config_has_sliding_and_global_layers(gemma3):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(gemma3)
    assert cfg.sliding_window == WINDOW and "full_attention" in cfg.layer_types
    assert cfg.layer_types.count("sliding_attention") == 3
    assert max(PROMPT_LENS) + NEW > 3 * WINDOW  # the window hides most of the context


def test_full_mode_greedy_equals_transformers_float32(gemma3):
    batch = prompts()
    ours, sched = serve(gemma3, batch, "float32")
    want = hf_greedy(gemma3, batch, "float32")
    assert [r.output_ids for r in ours] == want
    layers = sched.model_runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW, WINDOW, None, WINDOW]
    assert all(len(set(w)) >= 4 for w in want)  # informative, not one repeated token


# (seed, length) of prompts along whose float32 greedy path (10 tokens) the top-two logit gap stays
# >= MIN_GAP: bfloat16 rounding moves this random model's logits by ~1.3% of their spread (transformers'
# own eager and sdpa bfloat16 paths pick different tokens where the gap is ~0.05), so greedy tokens are
# one answer in bfloat16 only where the margins exceed that.
MARGIN_PROMPTS = [(0, 30), (2, 45), (16, 17), (18, 19), (22, 45)]
MIN_GAP = 0.15


def test_full_mode_greedy_equals_transformers_bfloat16(gemma3):
    batch = [torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(s)).tolist()
             for s, n in MARGIN_PROMPTS]
    gaps: list[float] = []
    want = hf_greedy(gemma3, batch, "float32", new=10, gaps=gaps)
    assert min(gaps) >= MIN_GAP  # the premise: clear margins all along
    assert hf_greedy(gemma3, batch, "bfloat16", new=10) == want
    ours, _ = serve(gemma3, batch, "bfloat16", new=10)
    assert [r.output_ids for r in ours] == want


def test_final_logit_softcapping_equals_transformers(tmp_path):
    path = make_random_checkpoint("gemma3", str(tmp_path / "capped"), final_logit_softcapping=3.0)
    batch = prompts([25, 14], seed=1)
    ours, sched = serve(path, batch, "float32")
    assert [r.output_ids for r in ours] == hf_greedy(path, batch, "float32")
    with torch.no_grad():
        logits = sched.model_runner.model.compute_logits(torch.randn(3, 64))
    assert float(logits.abs().max()) <= 3.0  # capped


def test_mistral_sliding_window_equals_transformers(tmp_path):
    path = make_random_checkpoint("mistral", str(tmp_path / "mistral"), sliding_window=8)
    batch = prompts([20, 11], seed=2)
    ours, _ = serve(path, batch, "float32")
    assert [r.output_ids for r in ours] == hf_greedy(path, batch, "float32")


@pytest.fixture(scope="module")
def deterministic_full(gemma3):
    return serve(gemma3, prompts(), "bfloat16", enable_deterministic_inference=True)[0]


def _same(got, want, label):
    assert [r.output_ids for r in got] == [r.output_ids for r in want], label
    assert [r.output_token_logprobs for r in got] == [r.output_token_logprobs for r in want], label


@pytest.mark.parametrize("compressor, server", [("snapkv", {}), ("kivi4", {}), ("kvzip", {}),
                                                ("expected_attention", {"kv_head_budget": "global"})])
def test_vericache_equals_deterministic_full_mode_bfloat16(gemma3, deterministic_full, compressor, server,
                                                          monkeypatch):
    """kvzip (global budgets, its default) and expected_attention with global budgets: the global layers share the
    segment's chunks, the sliding layers keep their own chunks and most recent tokens, read through their window."""
    from sglang_vericache.mem_cache import two_tier

    dealt, real = [], two_tier.compress_segment
    monkeypatch.setattr(two_tier, "compress_segment",
                        lambda c, kv, pool, slots, ids, *a: dealt.append((pool, ids, real(c, kv, pool, slots, ids, *a)))
                        or dealt[-1][2])
    vc, sched = serve(gemma3, prompts(), "bfloat16", enable_deterministic_inference=True, kv_compressor=compressor,
                      kv_compression_ratio=2, speculative_algorithm="VERICACHE", speculative_num_draft_tokens="4",
                      vericache_schedule="lockstep", **server)
    _same(vc, deterministic_full, compressor)
    assert getattr(sched.two_tier.compressor, "layer_global", False) == (compressor in ("kvzip", "expected_attention"))
    sliding = [i for i, t in enumerate(sched.model_runner.model_config.hf_config.layer_types) if t == "sliding_attention"]
    for pool, ids, chunks in dealt:
        if chunks is not None:  # global: a sliding layer's chunks are its own ids in its own buffer
            assert all(torch.equal(chunks[i], pool.layer_chunks(i, ids)) for i in sliding)
    assert any(chunks is not None for _, _, chunks in dealt) == (compressor in ("kvzip", "expected_attention"))
    assert sched.metrics.spec_rounds_total > 0
    types = sched.model_runner.model_config.hf_config.layer_types  # the sliding layers keep their recent tokens
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    assert sched.two_tier.compressor.config.sliding_layers == sliding and 0 < len(sliding) < len(types)


def test_deterministic_alone_equals_batched(gemma3, deterministic_full):
    alone = [serve(gemma3, [p], "bfloat16", enable_deterministic_inference=True)[0][0] for p in prompts()]
    _same(alone, deterministic_full, "alone vs batched")


def test_windowed_draft_context_starts_at_the_window():
    from sglang_vericache.layers.attention.draft_metadata import DraftMetadata, windowed_draft

    # chunks of T = 4 positions; request 0: 5 chunks (positions 0-19), tail 20-22, drafts 23-24 (query at 24);
    # request 1: 1 chunk (0-3), tail 4-5, drafts 6 (query at 6)
    i64 = dict(dtype=torch.int64)
    chunk_ids = torch.tensor([[11, 12, 13, 14, 15], [21, 0, 0, 0, 0]], **i64)
    chunk_lens, tail_lens, draft_lens = torch.tensor([5, 1]), torch.tensor([3, 2]), torch.tensor([2, 1])
    tail = torch.tensor([[120, 121, 122], [40, 41, 0]], **i64)
    draft = torch.tensor([[923, 924], [906, 0]], **i64)
    valid = lambda x, n: torch.arange(x.shape[1])[None, :] < n[:, None]  # noqa: E731
    md = DraftMetadata(2, "draft", chunk_ids, valid(chunk_ids, chunk_lens), tail, valid(tail, tail_lens), draft,
                       valid(draft, draft_lens), chunk_lens, tail_lens, draft_lens)
    assert windowed_draft(md, None, 4) is md and windowed_draft(md, 25, 4) is md  # the window hides nothing
    w = windowed_draft(md, 11, 4)  # request 0 sees positions 14-24: chunks 3, 4 (12-19), all its tail and drafts
    assert w.chunk_lens.tolist() == [2, 1] and w.chunk_ids[0, :2].tolist() == [14, 15] and w.chunk_ids[1, 0] == 21
    assert w.tail_lens.tolist() == [3, 2] and w.draft_lens.tolist() == [2, 1]
    assert windowed_draft(md, 11, 4) is w  # cached
    w = windowed_draft(md, 3, 4)  # request 0: positions 22-24; request 1: 4-6
    assert w.chunk_lens.tolist() == [0, 0] and not w.chunk_valid.any()
    assert w.tail_lens.tolist() == [1, 2] and w.tail_index[0, 0] == 122 and w.tail_index[1].tolist() == [40, 41, 0]
    assert w.draft_index[0].tolist() == [923, 924] and w.draft_valid[0].tolist() == [True, True]
    w = windowed_draft(md, 1, 4)  # only the query's own row
    assert w.tail_lens.tolist() == [0, 0] and w.draft_lens.tolist() == [1, 1]
    assert w.draft_index[:, 0].tolist() == [924, 906] and w.draft_valid.tolist() == [[True, False], [True, False]]
