"""sgl_kernel_ext.cpu_rowwise: the decoder layer's row-wise ops in one call each, bitwise equal to the
torch chains they replace (RoPE, SiLU-and-mul, RMSNorm), in every dtype, on strided views, alone or
in a batch; and the layers use them once deterministic inference is on."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel_ext import cpu_rowwise as cr

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 40])
def test_rotary_equals_the_torch_chain_on_qkv_views(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    qkv = (torch.randn(rows, 9 * 64 + 2 * 3 * 64, generator=g) * 3).to(dtype)
    q, k = qkv[:, : 9 * 64].view(rows, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(rows, 3, 64)
    angles = torch.rand(rows, 64, generator=g) * 100
    cos, sin = angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1)
    got, want = cr.rotary(q, k, cos, sin), cr.rotary_ref(q, k, cos, sin)
    assert same(got[0], want[0]) and same(got[1], want[1])
    alone = [cr.rotary(q[i : i + 1], k[i : i + 1], cos[i : i + 1], sin[i : i + 1]) for i in range(rows)]
    assert torch.equal(torch.cat([a[0] for a in alone]), got[0]) and torch.equal(torch.cat([a[1] for a in alone]), got[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 33])
def test_silu_and_mul_equals_the_torch_chain(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 1536, generator=g) * 6).to(dtype)
    x[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 200.0, -200.0, 1e-3, -1e-3]).to(dtype)  # exp over/underflow
    got = cr.silu_and_mul(x)
    assert same(got, cr.silu_and_mul_ref(x))
    assert same(cr.silu_and_mul(x.view(rows, 2, 2 * 768)), cr.silu_and_mul_ref(x.view(rows, 2, 2 * 768)))
    assert torch.equal(torch.cat([cr.silu_and_mul(x[i : i + 1]) for i in range(rows)]), got)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [None, torch.float32])
@pytest.mark.parametrize("rows", [1, 4, 29])
def test_rms_norm_equals_the_torch_chain(dtype, weight_dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 5).to(dtype)
    w = (torch.randn(576, generator=g) + 1).to(weight_dtype or dtype)
    got = cr.rms_norm(x, w, 1e-5)
    assert same(got, cr.rms_norm_ref(x, w, 1e-5))
    assert torch.equal(torch.cat([cr.rms_norm(x[i : i + 1], w, 1e-5) for i in range(rows)]), got)
    heads = x.view(rows, 9, 64)[:, 1:]  # a strided view over heads (Qwen3's q / k norms)
    assert same(cr.rms_norm(heads, w[:64], 1e-6), cr.rms_norm_ref(heads, w[:64], 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [7, 100, 576, 1536, 2048, 4099])
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_mean_is_torchs_to_the_bit_at_any_width(dtype, n, threads):
    """The kernel's mean (torch's float32 sum, then / n in C++) is torch's mean: widths whose division by n
    is inexact, rows that torch's reduction splits differently, values over a wide range of magnitudes."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(70, n, generator=g) * torch.logspace(-3, 3, 70).unsqueeze(1)).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cr.rms_norm(x, w, 1e-6)
    finally:
        torch.set_num_threads(before)
    assert same(got, cr.rms_norm_ref(x, w, 1e-6))


def test_bad_inputs_are_refused():
    x = torch.randn(2, 3, 64)
    with pytest.raises(RuntimeError, match="share one dtype"):
        cr.rotary(x, x.bfloat16(), x[:, :1], x[:, :1])
    with pytest.raises(RuntimeError, match="cos / sin"):
        cr.rotary(x, x, x, x)
    with pytest.raises(RuntimeError, match=r"x \[..., 2d\]"):
        cr.silu_and_mul(torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="weight \\[n\\]"):
        cr.rms_norm(x, torch.ones(63), 1e-6)


def test_layers_use_the_kernels_once_deterministic_inference_is_on():
    from sglang_vericache.layers import batch_invariant as bi
    from sglang_vericache.layers import rotary_embedding
    from sglang_vericache.layers.activation import SiluAndMul
    from sglang_vericache.layers.layernorm import RMSNorm
    from sglang_vericache.layers.linear import Linear

    torch.manual_seed(0)
    m = torch.nn.Sequential(RMSNorm(64, eps=1e-6), Linear(64, 48), SiluAndMul(), Linear(24, 64)).to(torch.bfloat16)
    m[0].weight.data.normal_()
    x = torch.randn(5, 64).to(torch.bfloat16)
    h = m[0](x)
    bi.enable_batch_invariance(m)
    assert m[0].batch_invariant_kernel is not None and m[2].kernel is not None and m[1].packed_op is not None
    assert rotary_embedding._cpu_kernel is not None
    assert torch.equal(m[0](x), h)  # the kernel, the same bits as the torch chain before
    y = m[1](h)
    assert torch.equal(y, m[1].matmul(h))  # forward's direct op call = matmul's packed branch
    assert same(m[2](y), cr.silu_and_mul_ref(y))


def test_fused_llama_layers_give_the_module_chains_bits():
    """The bundled (Llama) model with its decoder layers fused (the default on a CPU) and unfused:
    the same tokens and logprobs, prompts prefilled together and decoded as a batch."""
    from sglang_vericache.managers.scheduler import Scheduler
    from sglang_vericache.models.llama import LlamaDecoderLayer
    from sglang_vericache.server_args import ServerArgs
    from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

    sched = Scheduler(ServerArgs(skip_tokenizer_init=True, max_total_tokens=2048))
    layers = [m for m in sched.model_runner.model.modules() if isinstance(m, LlamaDecoderLayer)]
    assert layers and all(layer.fused_cpu for layer in layers)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, sched.vocab_size, (n,), generator=g).tolist() for n in (37, 5, 90)]

    def generate(tag: str) -> list:
        reqs = [make_request(f"{tag}{i}", p, return_logprob=True, max_new_tokens=12, temperature=0.0, ignore_eos=True)
                for i, p in enumerate(prompts)]
        res = run_to_completion(sched, reqs)
        return [(res[r.rid].output_ids, res[r.rid].output_token_logprobs) for r in reqs]

    fused = generate("f")
    for layer in layers:
        layer.fused_cpu = False
    assert generate("u") == fused
