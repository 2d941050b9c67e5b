"""CudaGraphRunner on a CPU: the runner's part of a CUDA graph (static buffers filled, padded to
the graph's batch size, the captured outputs read back; no host sync inside the captured forward)
with EagerGraph standing in for torch.cuda.CUDAGraph. Each forward the runner replays gives the
eager triton forward's logits, and every mode's greedy tokens are the eager ones. Kernels run
under TRITON_INTERPRET=1. The CUDA capture itself runs in benchmark/gpu/run_device_checks.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the triton backend cannot run")
pytest.importorskip("sgl_kernel_ext", reason="sgl-kernel-ext is not installed (pip install -e ...)")

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.model_executor.cuda_graph_runner import (
    CudaGraphRunner,
    EagerGraph,
    HostSyncError,
    default_capture_bs,
)
from sglang_vericache.server_args import ServerArgs, prepare_server_args
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import (
    greedy_outputs,
    random_prompts,
    record_forwards,
)

PROMPT_LENS = [21, 30, 13]  # 3 requests: replayed in the graph of 4 (one padding row)
NEW = 5
CAPTURE_BS = [1, 2, 4]
# A padded graph multiplies 4 rows where the eager forward multiplies 3: the CPU GEMM blocks them
# otherwise, so the logits differ in rounding (measured max |diff| 2.1e-5 at |logit| <= 18; with the
# graph of the batch's own size and the same split counts they are bitwise equal, tested below).
LOGITS_ATOL = 1e-4
VERICACHE = dict(speculative_algorithm="VERICACHE", speculative_num_draft_tokens="2", vericache_schedule="lockstep")
MODES = {
    "full": ({}, "DECODE"),
    "snapkv": (dict(kv_compressor="snapkv", **VERICACHE), "DRAFT_DECODE"),
    "kivi4": (dict(kv_compressor="kivi4", **VERICACHE), "DRAFT_DECODE"),
    # lossy snapkv drafts over the exact tail and captures each step's queries (graph outputs too)
    "lossy-snapkv": (dict(kv_compressor="snapkv"), "DRAFT_DECODE"),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))  # hidden 64, 2 layers, D 16


def _run(path: str, server: dict, graphs: bool, capture_bs=CAPTURE_BS, splits: int | None = None):
    """-> (output ids per request, [(forward mode, logits)] per forward, the graph runner or None).
    splits: every kernel's split-K count (default: eager by this step's lengths, graphs by capacity)."""
    sched = Scheduler(ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, page_size=8,
                                 attention_backend="triton", **server))
    runner = sched.model_runner
    assert runner.graph_runner is None  # a CPU never captures by itself
    if splits is not None:
        runner.attn_backend.default_splits = lambda *_: splits
    if graphs:
        runner.graph_runner = CudaGraphRunner(runner, capture_bs=capture_bs, graph_factory=EagerGraph)
    forwards = record_forwards(runner)
    return greedy_outputs(sched, random_prompts(PROMPT_LENS), NEW), forwards, runner.graph_runner


@pytest.fixture(scope="module")
def runs(llama):
    cache: dict[str, tuple] = {}

    def get(mode: str):
        if mode not in cache:
            server = MODES[mode][0]
            cache[mode] = (_run(llama, server, graphs=False), _run(llama, server, graphs=True))
        return cache[mode]

    return get


@pytest.mark.parametrize("mode", list(MODES))
def test_replayed_forwards_give_eager_tokens_and_logits(runs, mode):
    (want, eager, _), (got, replayed, _) = runs(mode)
    assert [len(o) for o in got] == [NEW] * len(PROMPT_LENS)
    assert got == want
    assert [m for m, _ in replayed] == [m for m, _ in eager]
    for i, ((m, a), (_, b)) in enumerate(zip(replayed, eager, strict=True)):
        assert a.shape == b.shape, f"forward {i} ({m})"
        torch.testing.assert_close(a, b, atol=LOGITS_ATOL, rtol=0, msg=f"forward {i} ({m})")


@pytest.mark.parametrize("mode", list(MODES))
def test_every_step_of_the_graphed_mode_is_replayed(runs, mode):
    """Each step of the mode's kind is one replay: of the graph of 4 while all 3 requests step
    together (VeriCache's last draft steps may hold fewer: the graph of their size); nothing failed
    to capture (a host sync inside the forward would have)."""
    _, (_, forwards, runner) = runs(mode)
    kind = MODES[mode][1]
    sizes = [len(a) for m, a in forwards if m == kind]
    want = {(kind, next(b for b in CAPTURE_BS if b >= n)): 0 for n in sizes}
    for n in sizes:
        want[(kind, next(b for b in CAPTURE_BS if b >= n))] += 1
    assert want[(kind, 4)] > 0
    assert dict(runner.replay_counts) == want
    assert runner.failed == set()
    assert len(runner.graphs) == len(want)


@pytest.mark.parametrize("mode", ["full", "snapkv"])
def test_unpadded_graph_with_the_same_splits_is_bitwise_eager(llama, mode):
    """The graph of the batch's own size, every kernel split twice in both runs: the same kernels
    over the same inputs, so a stale or unfilled static buffer would show as any difference."""
    server, kind = MODES[mode]
    want, eager, _ = _run(llama, server, graphs=False, splits=2)
    got, replayed, runner = _run(llama, server, graphs=True, capture_bs=[1, 2, 3], splits=2)
    assert got == want
    assert sum(runner.replay_counts.values()) == sum(m == kind for m, _ in replayed)
    assert runner.replay_counts[(kind, 3)] > 0
    for i, ((m, a), (_, b)) in enumerate(zip(replayed, eager, strict=True)):
        assert torch.equal(a, b), f"forward {i} ({m}): max |diff| {float((a - b).abs().max())}"


def test_batch_above_the_largest_graph_runs_eagerly(llama):
    want, _, _ = _run(llama, {}, graphs=False)
    got, _, runner = _run(llama, {}, graphs=True, capture_bs=[1, 2])  # every decode step holds 3
    assert got == want
    assert not runner.replay_counts and not runner.graphs


def test_fp8_drafting_runs_eagerly(llama):
    """fp8 chunks have no kernel (the torch path, with host syncs): drafting is never captured; the
    verify forwards never are (TARGET_VERIFY)."""
    server = dict(kv_compressor="fp8", **VERICACHE)
    want, _, _ = _run(llama, server, graphs=False)
    got, _, runner = _run(llama, server, graphs=True)
    assert got == want
    assert not runner.replay_counts and not runner.graphs


def test_capture_refuses_a_host_sync():
    def forward():
        x = torch.arange(4.0)
        return x * float(x.sum())  # .item(): a CUDA graph would freeze this value

    with pytest.raises(HostSyncError, match="_local_scalar_dense"):
        EagerGraph().capture(forward)
    with pytest.raises(HostSyncError, match="nonzero"):
        EagerGraph().capture(lambda: torch.arange(4).nonzero())


def test_eager_graph_replays_over_its_static_buffers():
    x = torch.ones(3)
    g = EagerGraph()
    out = g.capture(lambda: x * 2)
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    g.replay()
    assert out.tolist() == [2.0, 4.0, 6.0]


def test_capture_ladder_and_flags():
    assert default_capture_bs(1) == [1]
    assert default_capture_bs(6) == [1, 2, 4, 6]
    assert default_capture_bs(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    args = prepare_server_args(
        ["--cuda-graph-bs", "1", "3", "--cuda-graph-max-bs", "3", "--disable-cuda-graph"])
    assert (args.cuda_graph_bs, args.cuda_graph_max_bs, args.disable_cuda_graph) == ([1, 3], 3, True)
    with pytest.raises(ValueError, match="--cuda-graph-max-bs must be >= 1"):
        ServerArgs(cuda_graph_max_bs=0)
    with pytest.raises(ValueError, match="--cuda-graph-bs must be batch sizes >= 1"):
        ServerArgs(cuda_graph_bs=[0, 2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: real graph capture")
@pytest.mark.parametrize("mode", ["full", "snapkv", "kivi4", "lossy-snapkv"])
def test_cuda_graphs_on_a_gpu_give_eager_tokens(llama, mode):
    """On CUDA the ModelRunner captures real graphs itself; bfloat16, so kernels compile for a GPU."""
    def run(disable: bool):
        sched = Scheduler(ServerArgs(model_path=llama, dtype="bfloat16", skip_tokenizer_init=True,
                                     page_size=8, device="cuda", attention_backend="triton",
                                     enable_deterministic_inference=False,  # graphs: the opt-out's decode path
                                     disable_cuda_graph=disable, cuda_graph_bs=CAPTURE_BS, **MODES[mode][0]))
        return greedy_outputs(sched, random_prompts(PROMPT_LENS), NEW), sched.model_runner.graph_runner

    want, none = run(disable=True)
    got, runner = run(disable=False)
    assert none is None and got == want
    assert runner.failed == set() and sum(runner.replay_counts.values()) > 0
