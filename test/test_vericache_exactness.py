"""VeriCache emits exactly the full-KV output: every compressor, greedy and seeded sampling,
batches of mixed lengths, chunked prefill, radix-cache hits, stops inside a round, every family.

A divergence is reported with the full-KV top-two logit gap at the first differing position,
so floating-point noise at a near-tie is visible as such rather than hidden.
"""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.compress.registry import COMPRESSOR_NAMES
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

PROMPT_LENS = [40, 71, 9, 100, 23]
# Rounds are what these tests check: a fixed schedule (the adaptive default may decide to decode instead).
LOCKSTEP = {"vericache_schedule": "lockstep"}
NEW = 32


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


def prompts(n_lens=PROMPT_LENS, vocab=400, seed=0, prefix=0):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (prefix,), generator=g).tolist()
    return [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in n_lens]


def run(path, batch, sampling=None, seeds=None, **server):
    server.setdefault("page_size", 8)
    server = {**LOCKSTEP, **server}
    sched = Scheduler(ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, **server))
    sampling = sampling or {"temperature": 0.0}
    reqs = [
        make_request(f"r{i}", ids, seed=(seeds[i] if seeds else 0), max_new_tokens=NEW, ignore_eos=True,
                     **sampling)
        for i, ids in enumerate(batch)
    ]
    res = run_to_completion(sched, reqs)
    return [res[f"r{i}"] for i in range(len(batch))], sched


def top2_gap(path, ids) -> float:
    """Full-KV top-two logit gap for the next token after ids (for divergence reports)."""
    sched = Scheduler(ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, page_size=8))
    from sglang_vericache.testing.forward_batches import new_req, prepare_forward_batch

    runner = sched.model_runner
    logits = runner.forward(prepare_forward_batch(runner, [new_req(runner)], [ids]))[0]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_same(path, batch, full, other, label):
    for i, (f, o) in enumerate(zip(full, other)):
        if f.output_ids == o.output_ids:
            continue
        k = next(j for j, (a, b) in enumerate(zip(f.output_ids, o.output_ids)) if a != b)
        gap = top2_gap(path, batch[i] + f.output_ids[:k])
        pytest.fail(f"{label}: request {i} diverges at output token {k} "
                    f"(full {f.output_ids[k]}, got {o.output_ids[k]}); full-KV top-2 logit gap there: {gap:.3g}")


@pytest.mark.parametrize("compressor", COMPRESSOR_NAMES)
def test_greedy_equals_full_for_every_compressor(llama, compressor):
    batch = prompts()
    full, _ = run(llama, batch)
    vc, sched = run(llama, batch, kv_compressor=compressor, speculative_algorithm="VERICACHE",
                    speculative_num_draft_tokens="6")
    assert_same(llama, batch, full, vc, compressor)
    assert all(r.finished_reason == {"type": "length", "length": NEW} for r in vc)
    assert sched.metrics.spec_rounds_total > 0
    # Every emitted token came from a round: rounds + accepted drafts == tokens after the first.
    assert sched.metrics.spec_rounds_total + sched.metrics.spec_accepted_total == len(batch) * (NEW - 1)


@pytest.mark.parametrize("compressor", ["snapkv", "kivi4"])
def test_seeded_sampling_equals_full(llama, compressor):
    batch = prompts()
    sampling = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "frequency_penalty": 0.3}
    seeds = [11, 12, 13, 14, 15]
    full, _ = run(llama, batch, sampling, seeds)
    vc, _ = run(llama, batch, sampling, seeds, kv_compressor=compressor, speculative_algorithm="VERICACHE",
                speculative_num_draft_tokens="5")
    assert_same(llama, batch, full, vc, f"seeded {compressor}")
    assert len({tuple(r.output_ids) for r in full}) == len(batch)  # sampling really sampled


def test_batch_of_one_and_auto_draft_length(llama):
    batch = prompts([57])
    full, _ = run(llama, batch)
    vc, _ = run(llama, batch, kv_compressor="int8", speculative_algorithm="VERICACHE",
                speculative_num_draft_tokens="auto")
    assert_same(llama, batch, full, vc, "auto")
    # int8 drafts are accepted almost always, so auto lengthens rounds well past its minimum.
    assert vc[0].meta["spec_accept_length"] > 4


def test_chunked_prefill_and_radix_hits(llama):
    batch = prompts(prefix=33)
    full, _ = run(llama, batch)
    sched = Scheduler(ServerArgs(model_path=llama, dtype="float32", skip_tokenizer_init=True, page_size=8,
                                 **LOCKSTEP, chunked_prefill_size=16, kv_compressor="streamingllm",
                                 kv_compress_scope="page",  # both tiers shared page by page
                                 speculative_algorithm="VERICACHE", speculative_num_draft_tokens="4"))
    for tag in ("a", "b"):
        reqs = [make_request(f"{tag}{i}", ids, max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
                for i, ids in enumerate(batch)]
        res = run_to_completion(sched, reqs)
        assert_same(llama, batch, full, [res[f"{tag}{i}"] for i in range(len(batch))], f"pass {tag}")
    # The second pass hits both tiers for every whole page of each prompt but its last token.
    assert [res[f"b{i}"].cached_tokens for i in range(len(batch))] == [(len(p) - 1) // 8 * 8 for p in batch]
    assert sched.tree_cache.comp_hit_rate() > 0


def test_query_scored_compressor_with_radix_hits(llama):
    batch = prompts(prefix=33)
    full, _ = run(llama, batch)
    sched = Scheduler(ServerArgs(model_path=llama, dtype="float32", skip_tokenizer_init=True, page_size=8,
                                 **LOCKSTEP, kv_compressor="snapkv", speculative_algorithm="VERICACHE",
                                 speculative_num_draft_tokens="4"))
    for tag in ("a", "b"):
        reqs = [make_request(f"{tag}{i}", ids, max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
                for i, ids in enumerate(batch)]
        res = run_to_completion(sched, reqs)
        assert_same(llama, batch, full, [res[f"{tag}{i}"] for i in range(len(batch))], f"pass {tag}")


def test_stops_inside_a_round(llama):
    batch = prompts()
    full_free, _ = run(llama, batch)
    # Stop on a token each request emits mid-way, and cap others by max_new_tokens.
    stop_ids = [r.output_ids[NEW // 2] for r in full_free]

    def go(**server):
        sched = Scheduler(ServerArgs(model_path=llama, dtype="float32", skip_tokenizer_init=True, page_size=8,
                                     **LOCKSTEP, **server))
        reqs = [make_request(f"r{i}", ids, max_new_tokens=NEW - i, temperature=0.0, stop_token_ids=[stop_ids[i]],
                             min_new_tokens=2)
                for i, ids in enumerate(batch)]
        res = run_to_completion(sched, reqs)
        return [res[f"r{i}"] for i in range(len(batch))]

    full = go()
    vc = go(kv_compressor="int8", speculative_algorithm="VERICACHE", speculative_num_draft_tokens="16")
    assert [r.output_ids for r in vc] == [r.output_ids for r in full]
    assert [r.finished_reason for r in vc] == [r.finished_reason for r in full]
    assert any(r.finished_reason["type"] == "stop" for r in full)


def test_logprobs_come_from_the_verifier(llama):
    batch = prompts([30, 12])

    def go(**server):
        sched = Scheduler(ServerArgs(model_path=llama, dtype="float32", skip_tokenizer_init=True, page_size=8,
                                     **LOCKSTEP, **server))
        reqs = [make_request(f"r{i}", ids, max_new_tokens=NEW, temperature=0.0, ignore_eos=True,
                             return_logprob=True) for i, ids in enumerate(batch)]
        res = run_to_completion(sched, reqs)
        return [res[f"r{i}"] for i in range(len(batch))]

    full = go()
    vc = go(kv_compressor="knorm", speculative_algorithm="VERICACHE", speculative_num_draft_tokens="8")
    for f, v in zip(full, vc):
        assert [t for _, t in v.output_token_logprobs] == v.output_ids == f.output_ids
        got = torch.tensor([lp for lp, _ in v.output_token_logprobs])
        want = torch.tensor([lp for lp, _ in f.output_token_logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)  # exact logits, different op batching


def test_lossy_mode_diverges_where_vericache_does_not(llama):
    batch = prompts()
    full, _ = run(llama, batch)
    lossy, _ = run(llama, batch, kv_compressor="streamingllm", kv_compression_ratio=4)
    vc, _ = run(llama, batch, kv_compressor="streamingllm", kv_compression_ratio=4,
                speculative_algorithm="VERICACHE")
    assert [r.output_ids for r in vc] == [r.output_ids for r in full]
    assert sum(a.output_ids != b.output_ids for a, b in zip(lossy, full)) >= 3


@pytest.mark.parametrize("family", ["llama2", "mistral", "qwen2", "qwen3"])
def test_every_family(family, tmp_path):
    path = make_random_checkpoint(family, str(tmp_path))
    batch = prompts([33, 9, 64])
    full, _ = run(path, batch)
    vc, _ = run(path, batch, kv_compressor="snapkv", speculative_algorithm="VERICACHE",
                speculative_num_draft_tokens="6")
    assert_same(path, batch, full, vc, family)
