"""The scheduler's full-KV greedy output equals transformers' greedy generate, token for token.

Covers every supported family, a batch of mixed prompt lengths, chunked prefill, radix-cache
hits, and a KV pool far smaller than the workload (queueing and retraction).
"""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

FAMILIES = ["llama", "llama2", "mistral", "qwen2", "qwen3"]
PROMPT_LENS = [3, 17, 40, 9, 64, 26]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = make_random_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))
    return request.param, path


def prompts(vocab_size: int, shared_prefix: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    prefix = torch.randint(3, vocab_size, (shared_prefix,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(path: str, batch: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS is an ordinary token here
    outs = []
    with torch.no_grad():
        for ids in batch:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(out[0, len(ids):].tolist())
    return outs


def run_engine(path: str, batch: list[list[int]], **server_kwargs) -> tuple[list[list[int]], dict]:
    args = ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, **server_kwargs)
    sched = Scheduler(args)
    reqs = [
        make_request(f"r{i}", ids, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        for i, ids in enumerate(batch)
    ]
    res = run_to_completion(sched, reqs)
    return [res[f"r{i}"].output_ids for i in range(len(batch))], res


def vocab_of(path: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).vocab_size


def test_batch_matches_transformers(checkpoint):
    _, path = checkpoint
    batch = prompts(vocab_of(path))
    ours, res = run_engine(path, batch, page_size=4)
    assert ours == hf_greedy(path, batch, NEW_TOKENS)
    assert all(r.finished_reason == {"type": "length", "length": NEW_TOKENS} for r in res.values())


def test_chunked_prefill_and_radix_hits_match_transformers(checkpoint):
    _, path = checkpoint
    batch = prompts(vocab_of(path), shared_prefix=24)
    expected = hf_greedy(path, batch, NEW_TOKENS)
    args = ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, page_size=4,
                      chunked_prefill_size=8)
    sched = Scheduler(args)

    def submit(tag: str):
        reqs = [make_request(f"{tag}{i}", ids, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
                for i, ids in enumerate(batch)]
        return run_to_completion(sched, reqs)

    first = submit("a")
    second = submit("b")  # every prompt is now cached up to its last full page
    assert [first[f"a{i}"].output_ids for i in range(len(batch))] == expected
    assert [second[f"b{i}"].output_ids for i in range(len(batch))] == expected
    assert [second[f"b{i}"].cached_tokens for i in range(len(batch))] == [
        (len(ids) - 1) // 4 * 4 for ids in batch
    ]


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # memory pressure is family-independent
def test_small_pool_completes_with_same_output(family, tmp_path):
    path = make_random_checkpoint(family, str(tmp_path))
    batch = prompts(vocab_of(path)) * 2
    big, _ = run_engine(path, batch, page_size=4)
    small, res = run_engine(path, batch, page_size=4, max_total_tokens=96, chunked_prefill_size=16)
    assert small == big
    assert all(r.finished_reason["type"] == "length" for r in res.values())


def test_a_partial_prefill_gives_way_to_a_running_request_that_must_grow(tmp_path):
    """A pool that holds one request to its end: the second's prefill is admitted chunk by chunk into
    what the first has not used yet; when the first must grow, the partial prefill (the newest
    request, not in the running batch) is retracted, not left holding the pages."""
    path = make_random_checkpoint("llama", str(tmp_path))
    g = torch.Generator().manual_seed(7)
    batch = [torch.randint(3, 400, (24,), generator=g).tolist() for _ in range(2)]

    def run(**server):
        sched = Scheduler(ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, page_size=4,
                                     chunked_prefill_size=8, **server))
        reqs = [make_request(f"r{i}", ids, max_new_tokens=16, temperature=0.0, ignore_eos=True)
                for i, ids in enumerate(batch)]
        res = run_to_completion(sched, reqs)
        return [res[f"r{i}"].output_ids for i in range(2)], sched.metrics.num_retracted_total

    big, _ = run()
    small, retracted = run(max_total_tokens=11 * 4)  # 40 positions per request, a page to spare
    assert small == big and retracted > 0
