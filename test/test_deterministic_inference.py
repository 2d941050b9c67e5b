"""Deterministic inference (the default; --enable-deterministic-inference): a prompt's output (tokens and logprobs) is one function of
(checkpoint, prompt, seed), bitwise, in bfloat16, float16 and float32: alone or among 32
mixed-length concurrent requests, chunked prefill 64 or 512, prefix-cache hit or miss, 1 or 2
threads; and VeriCache (every compressor, lock-step and staggered) and lossy-mode-independent
drafting give exactly deterministic full mode's output, greedy and seeded.
"""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.compress.registry import COMPRESSOR_NAMES
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs, bundled_model_path
from sglang_vericache.testing.random_checkpoints import FAMILIES, make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, outputs_alone_or_among, run_to_completion

NEW = 24
TARGET_LENS = [5, 37, 70, 130]  # the requests compared
SEEDED = {"temperature": 0.9, "top_p": 0.95, "top_k": 40}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {f: make_random_checkpoint(f, str(tmp_path_factory.mktemp(f))) for f in sorted(FAMILIES)}


def random_prompts(lens, seed, vocab=400):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def scheduler(path, dtype, **server) -> Scheduler:
    server.setdefault("page_size", 8)
    return Scheduler(ServerArgs(model_path=path, dtype=dtype, skip_tokenizer_init=True, **server))


def request(rid, ids, sampling=None, seed=0, new=NEW):
    return make_request(rid, ids, seed=seed, return_logprob=True, max_new_tokens=new, ignore_eos=True,
                        **(sampling or {"temperature": 0.0}))


def outputs(sched, prompts, sampling=None, alone=False, crowd=()):
    """(output ids, output logprobs) of each prompt: all at once with the crowd's requests, or one at a time."""
    targets = [request(f"t{i}", ids, sampling, seed=100 + i) for i, ids in enumerate(prompts)]
    return outputs_alone_or_among(sched, targets, alone, crowd)


def crowd(n=28, seed=7):
    """Mixed-length concurrent requests around the targets: greedy and seeded, short and long outputs."""
    lens = [3 + (37 * i) % 150 for i in range(n)]
    return [request(f"c{i}", ids, None if i % 3 else SEEDED, seed=i, new=4 + (i * 5) % 24)
            for i, ids in enumerate(random_prompts(lens, seed))]


def assert_identical(expected, got, label):
    for i, ((ids_e, lp_e), (ids_g, lp_g)) in enumerate(zip(expected, got)):
        assert ids_g == ids_e, f"{label}: request {i} tokens differ at {next(k for k, (a, b) in enumerate(zip(ids_e, ids_g)) if a != b)}"
        assert lp_g == lp_e, f"{label}: request {i} logprobs differ"


# bfloat16 for every family (where rounding flips near-ties), float32 and float16 for two / one.
CASES = [(f, "bfloat16") for f in sorted(FAMILIES)] + [("llama", "float32"), ("qwen3", "float32"),
                                                        ("llama", "float16")]


@pytest.mark.parametrize(("family", "dtype"), CASES)
def test_alone_equals_under_load_chunked_and_cached(checkpoints, family, dtype):
    """Alone (chunked prefill 512, the default) == among 32 concurrent requests with chunked prefill
    64 == on a prefix-cache hit."""
    path = checkpoints[family]
    prompts = random_prompts(TARGET_LENS, seed=1)
    alone = outputs(scheduler(path, dtype), prompts, alone=True)
    assert_identical(alone, outputs(scheduler(path, dtype, chunked_prefill_size=64), prompts, crowd=crowd()),
                     "among 32 requests, chunked prefill 64")
    # A prefix-cache hit: the same prompts again on a warm scheduler (their prompts' pages are cached).
    warm = scheduler(path, dtype)
    outputs(warm, prompts)
    again = [request(f"h{i}", ids) for i, ids in enumerate(prompts)]
    res = run_to_completion(warm, again)
    assert sum(res[r.rid].cached_tokens for r in again) >= sum(n // 8 * 8 - 8 for n in TARGET_LENS)
    assert_identical(alone, [(res[r.rid].output_ids, res[r.rid].output_token_logprobs) for r in again], "cache hit")


@pytest.mark.parametrize("half_gemm", ["native", "float32"])
def test_batch_composition_alone_changes_nothing_with_the_default_chunk(checkpoints, half_gemm):
    """Among 32 requests with the default chunk size (the case above changes two things at once), with
    torch's bfloat16 products and with float32 ones (layers/half_gemm.py; auto picks one per CPU)."""
    path = checkpoints["llama"]
    prompts = random_prompts(TARGET_LENS, seed=1)
    alone = outputs(scheduler(path, "bfloat16", cpu_half_gemm=half_gemm), prompts, alone=True)
    assert_identical(alone, outputs(scheduler(path, "bfloat16", cpu_half_gemm=half_gemm), prompts, crowd=crowd()),
                     "among 32 requests")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_and_two_threads_agree(checkpoints, dtype):
    path = checkpoints["llama"]
    prompts = random_prompts(TARGET_LENS, seed=2)
    threads = torch.get_num_threads()
    try:
        one = outputs(scheduler(path, dtype, num_threads=1), prompts, crowd=crowd(12))
        two = outputs(scheduler(path, dtype, num_threads=2), prompts, crowd=crowd(12))
    finally:
        torch.set_num_threads(threads)
    assert_identical(one, two, "1 vs 2 threads")


@pytest.fixture(scope="module")
def qwen2_full(checkpoints):
    """Deterministic full mode's outputs for the compressor tests (greedy and seeded), among 6 others."""
    path, prompts = checkpoints["qwen2"], random_prompts(TARGET_LENS, seed=3)
    return {name: outputs(scheduler(path, "bfloat16"), prompts, sampling, crowd=crowd(4))
            for name, sampling in (("greedy", None), ("seeded", SEEDED))}


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
# kvzip_proxy, kvzap: kvzip's layout and rounds with other scorers (test_vericache_exactness and
# test_kvzap run them)
@pytest.mark.parametrize(("compressor", "schedule"), [(c, "lockstep") for c in COMPRESSOR_NAMES
                                                      if c not in ("kvzip_proxy", "kvzap")] + [
    (c, "staggered") for c in ("snapkv", "int8", "kivi4")])
def test_vericache_equals_deterministic_full_in_bfloat16(checkpoints, qwen2_full, compressor, schedule, sampling):
    path = checkpoints["qwen2"]
    prompts = random_prompts(TARGET_LENS, seed=3)
    vc = scheduler(path, "bfloat16", kv_compressor=compressor, speculative_algorithm="VERICACHE",
                   speculative_num_draft_tokens="6", vericache_schedule=schedule)
    got = outputs(vc, prompts, None if sampling == "greedy" else SEEDED, crowd=crowd(4))
    assert_identical(qwen2_full[sampling], got, f"{compressor} {schedule}")
    assert vc.metrics.spec_rounds_total > 0


def test_bundled_model_vericache_equals_full_in_bfloat16():
    """The server's default model and dtype: 8 prompts among a crowd, snapkv and int8, over a 1 GB/s link."""
    path = bundled_model_path()
    prompts = random_prompts([12, 50, 90, 160, 7, 33, 120, 64], seed=4, vocab=4000)
    full = outputs(scheduler(path, "bfloat16", page_size=16), prompts, crowd=crowd(8))
    assert_identical(full, outputs(scheduler(path, "bfloat16", page_size=16), prompts, alone=True), "alone")
    for compressor in ("snapkv", "int8"):
        vc = scheduler(path, "bfloat16", page_size=16, kv_compressor=compressor, speculative_algorithm="VERICACHE",
                       link_bandwidth="1GB")
        assert_identical(full, outputs(vc, prompts, crowd=crowd(8)), compressor)


def test_deterministic_by_default_in_every_mode_and_off_on_request():
    for server in ({}, dict(kv_compressor="snapkv", speculative_algorithm="VERICACHE"), dict(kv_compressor="snapkv"),
                   dict(kv_offload=True), dict(disagg_role="verifier", disagg_port=31999),
                   dict(kv_compressor="int8", speculative_algorithm="VERICACHE", disagg_role="drafter",
                        verifier_addr="tcp://127.0.0.1:31999"),
                   dict(tp_size=2), dict(device="cuda", attention_backend="triton")):
        assert ServerArgs(**server).enable_deterministic_inference is True, server
    assert ServerArgs(enable_deterministic_inference=True).enable_deterministic_inference is True
    for server in (dict(enable_deterministic_inference=False),
                   dict(kv_compressor="snapkv", enable_deterministic_inference=False),
                   dict(attention_backend="flashinfer"), dict(device="cuda")):  # no batch-invariant kernels there
        assert ServerArgs(**server).enable_deterministic_inference is False, server
    with pytest.raises(ValueError, match="not available with --attention-backend flashinfer"):
        ServerArgs(enable_deterministic_inference=True, attention_backend="flashinfer")
    with pytest.raises(ValueError, match="on CUDA needs --attention-backend triton"):
        ServerArgs(enable_deterministic_inference=True, device="cuda")
    assert ServerArgs(enable_deterministic_inference=True, attention_backend="triton").enable_deterministic_inference


def test_command_line_default_and_opt_out():
    from sglang_vericache.server_args import prepare_server_args

    assert prepare_server_args(["--model-path", "m"]).enable_deterministic_inference is True
    assert prepare_server_args(["--model-path", "m", "--enable-deterministic-inference"]).enable_deterministic_inference
    for flag in ("--disable-deterministic-inference", "--no-enable-deterministic-inference"):
        assert prepare_server_args(["--model-path", "m", flag]).enable_deterministic_inference is False


def test_opting_out_warns_that_outputs_may_change_with_batch_composition(checkpoints, caplog):
    with caplog.at_level("WARNING"):
        scheduler(checkpoints["llama"], "float32", enable_deterministic_inference=False)
    assert any("outputs may change with batch composition" in r.getMessage() for r in caplog.records)


def test_server_info_says_whether_it_is_on(checkpoints):
    on = scheduler(checkpoints["llama"], "float32").ready_message().server_info
    off = scheduler(checkpoints["llama"], "float32", enable_deterministic_inference=False).ready_message().server_info
    assert on["enable_deterministic_inference"] is True and on["batch_invariant_linear"] == "packed x16"
    assert off["enable_deterministic_inference"] is False and off["batch_invariant_linear"] is None


@pytest.fixture(scope="module")
def bf16_verifier(checkpoints):
    """A bfloat16 verifier (deterministic by default) in a thread of this process, on a loopback port."""
    import socket
    import threading

    from sglang_vericache.disagg.verifier import VerifierServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = VerifierServer(ServerArgs(model_path=checkpoints["llama"], dtype="bfloat16", skip_tokenizer_init=True,
                                       page_size=8, disagg_role="verifier", disagg_port=port))
    assert server.args.enable_deterministic_inference
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stop()
    thread.join(10)


@pytest.mark.parametrize("prefill", ["local", "verifier"])
def test_dual_instance_and_remote_prefill_equal_deterministic_full_in_bfloat16(checkpoints, bf16_verifier, prefill):
    path = checkpoints["llama"]
    prompts = random_prompts(TARGET_LENS, seed=5)
    for sampling in (None, SEEDED):
        full = outputs(scheduler(path, "bfloat16"), prompts, sampling, crowd=crowd(6))
        d = scheduler(path, "bfloat16", kv_compressor="int8", speculative_algorithm="VERICACHE",
                      speculative_num_draft_tokens="6", disagg_role="drafter", disagg_prefill=prefill,
                      verifier_addr=f"tcp://127.0.0.1:{bf16_verifier.args.disagg_port}")
        assert d.server_args.enable_deterministic_inference
        got = outputs(d, prompts, sampling, crowd=crowd(6))
        assert [ids for ids, _ in got] == [ids for ids, _ in full], f"{prefill} {sampling}"
        assert [lp for _, lp in got] == [lp for _, lp in full], f"{prefill} {sampling} logprobs"
