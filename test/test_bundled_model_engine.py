"""The bundled code model through our engine: identical greedy tokens to transformers, and
VeriCache identical to full KV on it, with the compressors it is benchmarked with."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs, bundled_model_path
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]
NEW = 48


@pytest.fixture(scope="module")
def tokenized():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_model_path())
    return [tok(p).input_ids for p in PROMPTS]


def engine(**server) -> Scheduler:
    return Scheduler(ServerArgs(model_path=bundled_model_path(), dtype="float32", skip_tokenizer_init=True,
                                page_size=16, **server))


def greedy(sched: Scheduler, prompts: list[list[int]]) -> list[list[int]]:
    reqs = [make_request(f"r{i}", ids, max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
            for i, ids in enumerate(prompts)]
    res = run_to_completion(sched, reqs)
    return [res[f"r{i}"].output_ids for i in range(len(prompts))]


def test_engine_matches_transformers_greedy(tokenized):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    want = []
    with torch.no_grad():
        for ids in tokenized:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            want.append(out[0, len(ids):].tolist())
    assert greedy(engine(), tokenized) == want


@pytest.mark.parametrize("compressor", ["snapkv", "streamingllm", "kivi2"])
def test_vericache_equals_full_on_the_bundled_model(tokenized, compressor):
    full = greedy(engine(), tokenized)
    sched = engine(kv_compressor=compressor, speculative_algorithm="VERICACHE", speculative_num_draft_tokens="8",
                   vericache_schedule="lockstep")
    assert greedy(sched, tokenized) == full
    # Every token after the first came out of a round: its verifier token or an accepted draft.
    m = sched.metrics
    assert m.spec_rounds_total + m.spec_accepted_total == len(tokenized) * (NEW - 1)
