"""--cpu-half-gemm (layers/half_gemm.py): half-precision linear layers through float32 products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_vericache.layers import half_gemm
from sglang_vericache.layers.linear import Linear
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, outputs_alone_or_among


def linear_model(dtype=torch.bfloat16, bias=True) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Linear(64, 48, bias=bias), Linear(48, 32, bias=False)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_products_are_float32_rounded_once_to_the_model_dtype(dtype):
    model = linear_model(dtype)
    x = torch.randn(7, 64).to(dtype)
    native = model[0](x)
    assert half_gemm.enable_float32_gemm(model) == (64 * 48 + 48 * 32) * 4
    lin = model[0]
    assert lin.weight.dtype == dtype and lin.gemm_weight.dtype == torch.float32 and lin.gemm_bias.dtype == torch.float32
    assert torch.equal(lin.gemm_weight.to(dtype), lin.weight)  # a half value is exact in float32
    y = lin(x)
    assert y.dtype == dtype
    assert torch.equal(y, F.linear(x.float(), lin.weight.float(), lin.bias.float()).to(dtype))
    # The same product as torch's half GEMM up to its summation order.
    assert (y.float() - native.float()).abs().max().item() <= 2 * native.float().abs().max().item() * 2**-7


def test_cpu_flags_decide_native_support():
    assert half_gemm.cpu_has_native(torch.bfloat16, "flags : fpu avx2 fma avx512_bf16")
    assert half_gemm.cpu_has_native(torch.bfloat16, "flags : fpu avx2 amx_bf16 amx_tile")
    assert not half_gemm.cpu_has_native(torch.bfloat16, "flags : fpu avx2 fma avx512f")
    assert not half_gemm.cpu_has_native(torch.float16, "flags : fpu avx2 avx512_bf16")
    assert half_gemm.cpu_has_native(torch.float16, "flags : avx512_fp16")
    assert half_gemm.cpu_has_native(torch.float32, "flags : fpu")


def test_policies(monkeypatch):
    bf16, fp32 = linear_model(torch.bfloat16), linear_model(torch.float32)
    assert half_gemm.use_float32(bf16, "float32", "cpu")
    assert not half_gemm.use_float32(bf16, "native", "cpu")
    assert not half_gemm.use_float32(fp32, "float32", "cpu")  # nothing to do in float32
    assert not half_gemm.use_float32(bf16, "float32", "cuda")  # a GPU multiplies half natively
    monkeypatch.setattr(half_gemm, "cpu_has_native", lambda dtype, flags=None: False)
    monkeypatch.setattr(half_gemm, "available_ram_bytes", lambda: 10**9)
    assert half_gemm.use_float32(bf16, "auto", "cpu")
    monkeypatch.setattr(half_gemm, "available_ram_bytes", lambda: 4 * (64 * 48 + 48 * 32) * 4 - 1)
    assert not half_gemm.use_float32(bf16, "auto", "cpu")  # the copies would take over a quarter of it
    monkeypatch.setattr(half_gemm, "cpu_has_native", lambda dtype, flags=None: True)
    monkeypatch.setattr(half_gemm, "available_ram_bytes", lambda: 10**9)
    assert not half_gemm.use_float32(bf16, "auto", "cpu")
    with pytest.raises(ValueError, match="--cpu-half-gemm must be one of"):
        half_gemm.use_float32(bf16, "fast", "cpu")
    with pytest.raises(ValueError, match="--cpu-half-gemm must be auto, native or float32"):
        ServerArgs(cpu_half_gemm="fp32")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


@pytest.mark.parametrize("half_gemm_policy", ["native", "float32"])
def test_vericache_equals_full_with_either_policy(llama, half_gemm_policy):
    """Under deterministic inference the policy changes nothing (its kernel reads the weights in their
    dtype: no float32 copies), and VeriCache's output (tokens and logprobs) is full mode's."""
    def run(**server):
        sched = Scheduler(ServerArgs(model_path=llama, dtype="bfloat16", skip_tokenizer_init=True, page_size=8,
                                     enable_deterministic_inference=True, cpu_half_gemm=half_gemm_policy, **server))
        assert not sched.model_runner.half_gemm_float32
        assert all(m.gemm_weight is None and m.packed is not None for m in half_gemm.linear_modules(sched.model_runner.model))
        g = torch.Generator().manual_seed(5)
        reqs = [make_request(f"t{i}", torch.randint(3, 400, (n,), generator=g).tolist(), return_logprob=True,
                             max_new_tokens=16, ignore_eos=True, temperature=0.0) for i, n in enumerate((9, 70, 130))]
        return outputs_alone_or_among(sched, reqs, False, ()), sched.metrics.spec_rounds_total

    full, _ = run()
    vc, rounds = run(kv_compressor="snapkv", speculative_algorithm="VERICACHE", speculative_num_draft_tokens="4",
                 vericache_schedule="lockstep")
    assert rounds > 0 and len(full) == 3 and all(len(ids) == 16 for ids, _ in full)
    assert full == vc


def test_float32_copies_only_with_deterministic_inference_off(llama):
    """--cpu-half-gemm float32 gives the float32 copies when deterministic inference is off; by default its
    packed kernel reads the bfloat16 weights themselves."""
    off = Scheduler(ServerArgs(model_path=llama, dtype="bfloat16", skip_tokenizer_init=True, page_size=8,
                               cpu_half_gemm="float32", enable_deterministic_inference=False)).model_runner
    assert off.half_gemm_float32 and off.batch_invariant_mode is None
    assert all(m.gemm_weight is not None and m.packed is None for m in half_gemm.linear_modules(off.model))
    on = Scheduler(ServerArgs(model_path=llama, dtype="bfloat16", skip_tokenizer_init=True, page_size=8,
                              cpu_half_gemm="float32")).model_runner
    assert not on.half_gemm_float32 and on.batch_invariant_linear_name() == "packed x16"
    assert all(m.packed.dtype == torch.bfloat16 and m.gemm_weight is None for m in half_gemm.linear_modules(on.model))
