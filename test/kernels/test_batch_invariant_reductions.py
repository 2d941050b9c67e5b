"""sgl_kernel_ext.batch_invariant_rmsnorm / batch_invariant_softmax: equal to the torch reference to
rounding, and a row's result is bitwise the same whatever the number of rows and wherever the row
sits (TRITON_INTERPRET=1 on a CPU: one program per row, so tiny shapes)."""

from __future__ import annotations

import kernel_inputs  # noqa: F401  (skips this module without triton)
import pytest
import torch

from sgl_kernel_ext.batch_invariant_rmsnorm import rms_norm, rms_norm_ref
from sgl_kernel_ext.batch_invariant_softmax import log_softmax, logsumexp

DEVICE = kernel_inputs.DEVICE
PLACES = [(0, 1), (2, 1), (1, 3), (0, 6)]  # (start, rows) of the 6-row batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_reference_and_is_row_invariant(gen, dtype):
    x = (torch.randn(6, 40, generator=gen) * 3).to(dtype).to(DEVICE)  # 40: a masked tail of the 64-lane block
    w = (torch.rand(40, generator=gen) + 0.5).to(dtype).to(DEVICE)
    full = rms_norm(x, w, 1e-5)
    ref = rms_norm_ref(x, w, 1e-5)
    assert full.dtype == ref.dtype == dtype and full.shape == (6, 40)
    if dtype == torch.float32:
        torch.testing.assert_close(full, ref, rtol=1e-6, atol=1e-6)
    else:  # two bf16 roundings (h, then w * h), each one ulp apart at most (the interpreter's cast may truncate)
        torch.testing.assert_close(full.float(), ref.float(), rtol=2 * 2**-7, atol=1e-2)
    for start, rows in PLACES:
        assert torch.equal(rms_norm(x[start : start + rows], w, 1e-5), full[start : start + rows])
    assert torch.equal(rms_norm(x.view(2, 3, 40), w, 1e-5), full.view(2, 3, 40))


def test_rms_norm_refuses_a_mismatched_weight():
    with pytest.raises(ValueError, match="does not match"):
        rms_norm(torch.ones(2, 8), torch.ones(9), 1e-5)


def test_log_softmax_and_logsumexp_match_torch_and_are_row_invariant(gen):
    x = (torch.randn(6, 300, generator=gen) * 4).to(DEVICE)  # 300: a masked tail of the 512-wide block
    x[4, :150] = float("-inf")  # masked tokens, as penalties and filters leave them
    full, lse = log_softmax(x), logsumexp(x)
    torch.testing.assert_close(full, torch.log_softmax(x, -1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(x, -1), rtol=1e-6, atol=1e-5)
    assert torch.equal(full[4, :150], torch.full((150,), float("-inf"), device=DEVICE))
    for start, rows in PLACES:
        assert torch.equal(log_softmax(x[start : start + rows]), full[start : start + rows])
        assert torch.equal(logsumexp(x[start : start + rows]), lse[start : start + rows])


def test_a_row_of_minus_infinity_gives_what_torch_gives():
    x = torch.full((1, 10), float("-inf"), device=DEVICE)
    assert logsumexp(x).item() == float("-inf")
    assert torch.isnan(log_softmax(x)).all()


def test_the_triton_mode_wires_rms_norm_and_the_samplers_row_reductions(gen):
    """enable_batch_invariance(..., "triton", row_kernels=True) routes RMSNorm through the kernel
    (the GPU default), and Sampler(batch_invariant_triton=True) its logprobs through log_softmax."""
    from sglang_vericache.layers.batch_invariant import enable_batch_invariance, uses_triton_row_kernels
    from sglang_vericache.layers.layernorm import RMSNorm
    from sglang_vericache.layers.sampler import Sampler
    from sglang_vericache.sampling.sampling_batch_info import SamplingBatchInfo, SamplingRow
    from sglang_vericache.sampling.sampling_params import SamplingParams

    assert uses_triton_row_kernels(True, "triton", "cuda:0")
    assert not uses_triton_row_kernels(True, "triton", "cpu") and not uses_triton_row_kernels(False, "triton", "cuda")
    model = torch.nn.Sequential(RMSNorm(24, eps=1e-6)).to(DEVICE)
    with torch.no_grad():
        model[0].weight.copy_(torch.rand(24, generator=gen) + 0.5)
    x = torch.randn(3, 24, generator=gen).to(DEVICE)
    enable_batch_invariance(model, "triton", row_kernels=True)
    assert torch.equal(model(x), rms_norm(x, model[0].weight, 1e-6))
    enable_batch_invariance(model, "triton", row_kernels=False)
    assert model[0].batch_invariant_kernel is None

    logits = torch.randn(3, 50, generator=gen).to(DEVICE)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9),  # top-p: logsumexp
              SamplingParams(temperature=0.8, top_k=5, top_p=0.9)]
    info = SamplingBatchInfo.from_rows([SamplingRow(p, 7, 3, [], []) for p in params], 50, DEVICE)
    out = Sampler(batch_invariant_triton=True)(logits, info, return_logprob=True)
    assert torch.equal(out.logprobs, log_softmax(logits).gather(1, out.next_token_ids[:, None]).squeeze(1))
    assert torch.equal(out.next_token_ids, Sampler()(logits, info).next_token_ids)
