"""--device cuda end to end (skips without CUDA): every mode runs on the GPU, VeriCache and lossy
included, with the torch and triton backends; VeriCache's tokens equal full mode's there, and full
mode's equal the CPU's (float32, a random model whose greedy margins are wide)."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import greedy_outputs, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT_LENS = [21, 30, 13]
NEW = 10
VERICACHE = dict(speculative_algorithm="VERICACHE", speculative_num_draft_tokens="3", vericache_schedule="lockstep")
MODES = {
    "full": {},
    "vericache-snapkv": dict(kv_compressor="snapkv", **VERICACHE),
    "vericache-kivi4": dict(kv_compressor="kivi4", **VERICACHE),
    "vericache-staggered-link": dict(kv_compressor="int8", link_bandwidth="1GB", **{**VERICACHE, "vericache_schedule": "staggered"}),
    "lossy-streamingllm": dict(kv_compressor="streamingllm"),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


def _outputs(path, device, backend="torch", **server):
    sched = Scheduler(ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, page_size=8,
                                 device=device, attention_backend=backend, **server))
    return greedy_outputs(sched, random_prompts(PROMPT_LENS), NEW)


@pytest.fixture(scope="module")
def full_cpu(llama):
    return _outputs(llama, "cpu")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_runs_on_cuda(llama, full_cpu, mode, backend):
    got = _outputs(llama, "cuda", backend, **MODES[mode])
    assert [len(o) for o in got] == [NEW] * len(PROMPT_LENS)
    if not mode.startswith("lossy"):
        assert got == full_cpu
