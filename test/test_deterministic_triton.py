"""--enable-deterministic-inference on the triton backend (issue 14's GPU path; Triton kernels under
TRITON_INTERPRET=1 here): batch_invariant_matmul for every linear layer and fixed_split_attention for
every attention row. Bitwise, tokens and logprobs: a request alone == among other requests of other
lengths with another chunked-prefill size; deterministic VeriCache (snapkv, int8) == deterministic
full mode; bfloat16 and float32. Tiny on purpose (the interpreter costs ~1 ms per Triton op).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the triton backend cannot run")
pytest.importorskip("sgl_kernel_ext", reason="sgl-kernel-ext is not installed (pip install -e ...)")

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, outputs_alone_or_among

NEW = 5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on a CPU
PROMPT_LENS = [5, 70]  # 70: two chunks of keys by the last position (the chunk boundary at 64)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))  # hidden 64, 2 layers, D 16


@pytest.fixture(autouse=True)
def no_cpu_kernel(monkeypatch):
    """The CPU kernel must never run on the triton backend: a fallback through it would agree only to rounding."""
    from sgl_kernel_ext import cpu_attention

    def refuse(*args, **kwargs):
        raise AssertionError("the CPU fixed-chunk kernel ran on the triton backend")

    monkeypatch.setattr(cpu_attention, "fixed_chunk_attention", refuse)


def _scheduler(path, dtype, **server) -> Scheduler:
    return Scheduler(ServerArgs(model_path=path, dtype=dtype, skip_tokenizer_init=True, page_size=8, device=DEVICE,
                                attention_backend="triton", enable_deterministic_inference=True, **server))


def _prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lens]


def _request(rid, ids, new=NEW):
    return make_request(rid, ids, return_logprob=True, max_new_tokens=new, ignore_eos=True, temperature=0.0)


def _outputs(sched, alone=False, crowd=(), lens=PROMPT_LENS, new=NEW):
    """(output ids, output logprobs) of each `lens` prompt: one at a time, or all with the crowd."""
    targets = [_request(f"t{i}", ids, new) for i, ids in enumerate(_prompts(lens, 1))]
    return outputs_alone_or_among(sched, targets, alone, crowd)


@pytest.fixture(scope="module")
def full_alone(llama):
    """Deterministic full mode, each request alone (default chunked prefill), per dtype."""
    cache = {}

    def get(dtype):
        if dtype not in cache:
            sched = _scheduler(llama, dtype)
            cache[dtype] = (_outputs(sched, alone=True), sched)
        return cache[dtype]

    return get


def _assert_identical(want, got, label, new=NEW):
    for i, ((ids_w, lp_w), (ids_g, lp_g)) in enumerate(zip(want, got)):
        assert len(ids_w) == new and ids_g == ids_w, f"{label}: request {i} tokens differ"
        assert lp_g == lp_w, f"{label}: request {i} logprobs differ"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_alone_equals_among_other_requests_with_another_chunking(llama, full_alone, dtype):
    want, sched = full_alone(dtype)
    backend = sched.model_runner.attn_backend
    assert set(backend.path_counts) == {"fixed_split"}  # EXTEND and DECODE read the pool directly
    crowd = [_request(f"c{i}", ids, new=2 + i) for i, ids in enumerate(_prompts([20, 9, 100], 2))]
    got = _outputs(_scheduler(llama, dtype, chunked_prefill_size=32), crowd=crowd)
    _assert_identical(want, got, "among 3 requests, chunked prefill 32")


# int8: staggered over a 1 GB/s link (staged verify rows and MIXED batches: the torch path's layouts)
@pytest.mark.parametrize(("compressor", "dtype", "link"), [("snapkv", "bfloat16", None), ("int8", "bfloat16", "1GB"),
                                                           ("snapkv", "float32", None)])
def test_vericache_equals_deterministic_full(llama, full_alone, compressor, dtype, link):
    want, _ = full_alone(dtype)
    vc = _scheduler(llama, dtype, kv_compressor=compressor, speculative_algorithm="VERICACHE",
                    speculative_num_draft_tokens="3", link_bandwidth=link,
                    vericache_schedule="staggered" if link else "lockstep")  # rounds under test
    _assert_identical(want, _outputs(vc), f"VeriCache {compressor}")
    assert vc.metrics.spec_rounds_total > 0 and vc.server_args.staggered == (link is not None)
    backend = vc.model_runner.attn_backend
    assert backend.fused_draft is False
    # verify rows through the pool directly; draft rows through the torch path's context, same kernel
    assert set(backend.path_counts) == {"fixed_split", "torch"}


def test_server_info_and_settings(llama, full_alone):
    _, sched = full_alone("bfloat16")
    info = sched.ready_message().server_info
    assert info["enable_deterministic_inference"] is True and info["batch_invariant_linear"] == "triton"
    assert sched.model_runner.graph_runner is None


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs an NVIDIA GPU (CUDA)")
def test_under_load_on_gpu_bfloat16(llama):
    """On a GPU, where torch's own CUDA reductions (RMSNorm, log_softmax) also run: 6 prompts alone ==
    among 24 mixed-length requests with chunked prefill 64 == VeriCache snapkv among them, 24 tokens."""
    lens, new = [5, 37, 70, 130, 9, 200], 24
    want = _outputs(_scheduler(llama, "bfloat16"), alone=True, lens=lens, new=new)
    crowd = [_request(f"c{i}", ids, new=4 + (5 * i) % 24)
             for i, ids in enumerate(_prompts([3 + (37 * i) % 180 for i in range(18)], 7))]
    got = _outputs(_scheduler(llama, "bfloat16", chunked_prefill_size=64), crowd=crowd, lens=lens, new=new)
    _assert_identical(want, got, "among 24 requests", new)
    vc = _scheduler(llama, "bfloat16", kv_compressor="snapkv", speculative_algorithm="VERICACHE",
                    speculative_num_draft_tokens="4", vericache_schedule="lockstep")
    _assert_identical(want, _outputs(vc, crowd=crowd, lens=lens, new=new), "VeriCache snapkv", new)
