"""The triton attention backend (sgl-kernel-ext kernels, torch fallback for the rest) gives the torch
backend's greedy tokens and, forward by forward, its logits: full mode (EXTEND falls back, DECODE on
the paged decode kernel) and VeriCache (DRAFT_DECODE on the token-drop / quantized kernels with the
draft-pool rows, TARGET_VERIFY on the verify kernel). Kernels run under TRITON_INTERPRET=1 on CPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the triton backend cannot run")
pytest.importorskip("sgl_kernel_ext", reason="sgl-kernel-ext is not installed (pip install -e ...)")

from sglang_vericache.layers.attention.registry import get_attention_backend_class
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import (
    greedy_outputs,
    random_prompts,
    record_forwards,
)

PROMPT_LENS = [21, 30]  # page 8: both last pages partly filled (5 and 6 of 8 tokens)
NEW = 8
# float32 everywhere; kernels use an online softmax + split merge (vs one SDPA softmax): logits of
# this random model (|logit| up to ~20) agree to ~3e-5 (measured); 2e-4 leaves room, far below a top-2 gap.
LOGITS_ATOL = 2e-4
VERICACHE = dict(speculative_algorithm="VERICACHE", speculative_num_draft_tokens="3", vericache_schedule="lockstep")
MODES = {"full": {}, **{c: dict(kv_compressor=c, **VERICACHE) for c in ("snapkv", "kivi4")}}
# layer calls of each kernel path a mode must make (the rest: EXTEND on the torch path)
KERNEL_PATHS = {
    "full": {"decode"}, "snapkv": {"verify", "draft_token_drop"}, "kivi4": {"verify", "draft_quantized"},
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))  # hidden 64, 2 layers, D 16


def _run(path: str, backend: str, server: dict):
    """-> (output ids per request, [(forward mode, logits)] per forward, the backend)."""
    sched = Scheduler(ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, page_size=8,
                                 attention_backend=backend, **server))
    forwards = record_forwards(sched.model_runner)
    return greedy_outputs(sched, random_prompts(PROMPT_LENS), NEW), forwards, sched.model_runner.attn_backend


@pytest.fixture(scope="module")
def runs(llama):
    cache: dict[str, tuple] = {}

    def get(mode: str):
        if mode not in cache:
            cache[mode] = (_run(llama, "torch", MODES[mode]), _run(llama, "triton", MODES[mode]))
        return cache[mode]

    return get


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_tokens_equal_torch_backend(runs, mode):
    (want, _, _), (got, _, _) = runs(mode)
    assert [len(o) for o in got] == [NEW] * len(PROMPT_LENS)
    assert got == want


@pytest.mark.parametrize("mode", list(MODES))
def test_every_forward_logits_close_to_torch_backend(runs, mode):
    (_, want, _), (_, got, _) = runs(mode)
    assert [m for m, _ in got] == [m for m, _ in want]
    for i, ((m, a), (_, b)) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"forward {i} ({m})"
        torch.testing.assert_close(a, b, atol=LOGITS_ATOL, rtol=0, msg=f"forward {i} ({m})")


@pytest.mark.parametrize("mode", list(MODES))
def test_kernel_paths_carry_their_modes(runs, mode):
    """No silent fallback: DECODE / TARGET_VERIFY / DRAFT_DECODE layers all ran on kernels; the torch
    path ran only for EXTEND (prefill) layers: 2 layers x one prefill forward of the batch."""
    _, (_, forwards, backend) = runs(mode)
    counts = backend.path_counts
    assert {p for p in counts if p != "torch"} == KERNEL_PATHS[mode]
    layers = 2
    assert counts["torch"] == layers * sum(m == "EXTEND" for m, _ in forwards)
    assert sum(counts.values()) == layers * len(forwards)


def test_fp8_drafting_falls_back_to_torch_path(llama):
    """fp8 chunks have no kernel: DRAFT_DECODE layers take the torch path, tokens still equal torch's."""
    server = dict(kv_compressor="fp8", speculative_algorithm="VERICACHE", speculative_num_draft_tokens="2",
                  vericache_schedule="lockstep")
    want, _, _ = _run(llama, "torch", server)
    got, forwards, backend = _run(llama, "triton", server)
    assert got == want
    assert "draft_quantized" not in backend.path_counts and backend.path_counts["verify"] > 0
    non_kernel = sum(m in ("EXTEND", "DRAFT_DECODE") for m, _ in forwards)
    assert backend.path_counts["torch"] == 2 * non_kernel


def test_registry_names_the_backends():
    from sglang_vericache.layers.attention.triton_backend import TritonAttnBackend

    assert get_attention_backend_class("triton") is TritonAttnBackend
    assert get_attention_backend_class("flashinfer").__name__ == "FlashInferAttnBackend"


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the kernels compile: no interpreter needed")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        get_attention_backend_class("triton")(None)


def test_flashinfer_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only error")
    msg = "--attention-backend flashinfer needs an NVIDIA GPU with the flashinfer package installed"
    with pytest.raises(RuntimeError, match=msg):
        get_attention_backend_class("flashinfer")(None)
