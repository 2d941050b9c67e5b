"""Composed compressors (DROP+QUANT) end to end: VeriCache output equals full mode's, and lossy mode
serves from the composed tier. Single compressors are covered, every registered name, by
test_vericache_exactness.py::test_greedy_equals_full_for_every_compressor."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

PROMPT_LENS = [40, 71, 9, 100]
NEW = 32


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


def prompts(seed=0, vocab=400):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def run(path, batch, **server):
    sched = Scheduler(
        ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, page_size=8, **server)
    )
    reqs = [
        make_request(f"r{i}", ids, max_new_tokens=NEW, ignore_eos=True, temperature=0.0)
        for i, ids in enumerate(batch)
    ]
    res = run_to_completion(sched, reqs)
    return [res[f"r{i}"].output_ids for i in range(len(batch))], sched


@pytest.fixture(scope="module")
def full(llama):
    return run(llama, prompts())[0]


@pytest.mark.parametrize("compressor", ["snapkv+kivi4", "kvzip+kvquant3"])
def test_vericache_with_a_composed_tier_equals_full(llama, full, compressor):
    vc, sched = run(
        llama,
        prompts(),
        kv_compressor=compressor,
        kv_compression_ratio=2,
        speculative_algorithm="VERICACHE",
        speculative_num_draft_tokens="6",
        vericache_schedule="lockstep",  # rounds under test (adaptive may decode instead)
    )
    assert vc == full
    assert sched.metrics.spec_rounds_total > 0
    assert sched.metrics.spec_rounds_total + sched.metrics.spec_accepted_total == len(full) * (NEW - 1)
    assert type(sched.two_tier.compressor).__name__ == "ComposedCompressor"
    assert sched.two_tier.pool.layouts[0].rows == 4  # page 8 at ratio 2, then quantized
