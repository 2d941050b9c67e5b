"""The triton attention backend (sgl-kernel-ext kernels, torch fallback for the rest) gives the torch
backend's greedy tokens and, forward by forward, its logits: full mode (EXTEND falls back, DECODE on
the paged decode kernel) and VeriCache (DRAFT_DECODE on the token-drop / quantized / pre-RoPE
(kvquant, rotatekv, also after a dropper) kernels with the draft-pool rows, TARGET_VERIFY on the
verify kernel). Kernels run under TRITON_INTERPRET=1 on CPU.
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
MODES = {"full": {}, **{c: dict(kv_compressor=c, **VERICACHE) for c in ("snapkv", "kivi4", "kvquant4")}}
# layer calls of each kernel path a mode must make (the rest: EXTEND on the torch path)
KERNEL_PATHS = {
    "full": {"decode"}, "snapkv": {"verify", "draft_token_drop"}, "kivi4": {"verify", "draft_quantized"},
    "kvquant4": {"verify", "draft_prerope"},
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


@pytest.mark.parametrize(("compressor", "path"), [("snapkv+kvquant3", "draft_prerope"),
                                                   ("knorm+rotatekv4", "draft_prerope"),
                                                   ("snapkv+kivi4", "draft_quantized")])
def test_composed_draft_step_on_its_quantizers_kernel_equals_the_torch_path(llama, compressor, path,
                                                                           monkeypatch):
    """DROP+QUANT (pre-RoPE quantizers: each head's kept rows at their own positions): one DRAFT_DECODE
    step of a ragged batch (0, 1 and 3 compressed pages, previous drafts) takes its quantizer's kernel on
    every layer, and its logits equal the same step on the torch path (the kernel paths switched off)."""
    from sglang_vericache.layers.attention import triton_backend
    from sglang_vericache.model_executor.model_runner import ModelRunner
    from sglang_vericache.testing.draft_batches import DraftPool, compress_prefix, make_compressed_pool, \
        prepare_draft_batch
    from sglang_vericache.testing.forward_batches import new_req, prepare_forward_batch

    runner = ModelRunner(ServerArgs(model_path=llama, dtype="float32", page_size=8,
                                    attention_backend="triton", max_total_tokens=512, max_running_requests=4))
    gen = torch.Generator().manual_seed(0)
    lens = [(6, 1), (13, 0), (30, 2)]  # (committed tokens with exact KV, previous drafts)
    seqs = [torch.randint(3, 400, (n + j + 1,), generator=gen).tolist() for n, j in lens]
    reqs = [new_req(runner) for _ in seqs]
    runner.forward(prepare_forward_batch(runner, reqs, [s[:-1] for s in seqs]))
    cpool = make_compressed_pool(runner, compressor, ratio=2, num_chunks=16, group_size=8)
    draft = DraftPool(runner, num_slots=16)
    dreqs = []
    for req, (n, j) in zip(reqs, lens):
        req.kv_len = n  # positions n .. n + j - 1 become previous drafts (their exact K/V copied over)
        d = compress_prefix(runner, cpool, req, n // 8, random_queries=gen)
        src = runner.req_to_token_pool.req_to_token[req.pool_idx, n : n + j]
        d.draft_slots = [draft.alloc() for _ in range(j)]
        for layer in range(runner.model_config.num_hidden_layers):
            draft.kv.set_kv_buffer(layer, torch.tensor(d.draft_slots, dtype=torch.int64),
                                   runner.token_to_kv_pool.get_key_buffer(layer)[src],
                                   runner.token_to_kv_pool.get_value_buffer(layer)[src])
        dreqs.append(d)
    fb = prepare_draft_batch(runner, cpool, dreqs, [s[-1] for s in seqs], draft)
    backend = runner.attn_backend
    kernel = runner.forward(fb)
    assert dict(backend.path_counts) == {"torch": 2, path: 2}  # prefill, then the draft step
    monkeypatch.setattr(triton_backend, "PREROPE_KINDS", ())
    monkeypatch.setattr(triton_backend, "QUANTIZED_KINDS", ())
    torch_path = runner.forward(fb)
    assert backend.path_counts["torch"] == 4
    torch.testing.assert_close(kernel, torch_path, atol=LOGITS_ATOL, rtol=0)


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


@pytest.mark.parametrize("window, dealt", [(4, True), (100, False)])
def test_dealt_layer_chunks_draft_on_the_torch_path(llama, monkeypatch, window, dealt):
    """PyramidKV in segment scope deals a segment's chunks to the layers by its per-segment budgets: each layer's
    own chunks, which the token-drop kernel does not read, so its DRAFT_DECODE layers take the torch path. Its
    fallback (SnapKV's uniform budget: here with a window of 100 over 2x of ~200 tokens) deals each layer its own
    ids, and the kernel reads them. Tokens equal the torch backend's either way."""
    from sglang_vericache.compress import pyramidkv

    monkeypatch.setattr(pyramidkv, "SEGMENT_WINDOW", window)
    server = dict(kv_compressor="pyramidkv", kv_compression_ratio=2, speculative_algorithm="VERICACHE",
                  speculative_num_draft_tokens="2", vericache_schedule="lockstep")
    prompts = random_prompts([170, 203])
    sched = {}
    got = {}
    for backend in ("torch", "triton"):
        sched[backend] = Scheduler(ServerArgs(model_path=llama, dtype="float32", skip_tokenizer_init=True,
                                              page_size=8, attention_backend=backend, **server))
        got[backend] = greedy_outputs(sched[backend], prompts, NEW)
    assert got["triton"] == got["torch"]
    counts = sched["triton"].model_runner.attn_backend.path_counts
    assert counts["verify"] > 0 and ("draft_token_drop" in counts) != dealt


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
