"""layers.batch_invariant's choice of matrix-product mode (--enable-deterministic-inference).

The probe catches a library kernel that rounds a row differently only when the row is computed alone
somewhere past the probe's first offsets (a Sapphire Rapids Xeon's one-row bfloat16 kernel did so, for one
output in ~30 000), and on a CPU with native half-precision dot products bfloat16 / float16 products are
always computed one BLOCK_ROWS-row block per call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_vericache.layers import batch_invariant as bi
from sglang_vericache.layers import half_gemm
from sglang_vericache.layers.linear import Linear


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(bi, "_cache_path", lambda: tmp_path / "batch_invariance.json")


def model(dtype, bias=False):
    torch.manual_seed(0)
    return torch.nn.Sequential(Linear(64, 48, bias=bias).to(dtype), Linear(48, 64, bias=bias).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_half_products_are_always_blocked(monkeypatch, dtype):
    monkeypatch.setattr(half_gemm, "cpu_has_native", lambda dt, flags=None: True)
    assert bi.choose_linear_mode(model(dtype)) == ("blocked", bi.BLOCK_ROWS)
    assert bi.choose_linear_mode(model(dtype, bias=True)) == ("blocked", bi.BLOCK_ROWS)


def test_a_row_rounded_differently_alone_past_the_first_offsets_is_caught(monkeypatch):
    """A fake library product that changes one output's last bit when row 42 of the probe's input is
    computed alone: the batch-size probes (offsets 0 and 3) never call it alone there; the one-row sweep does."""
    real = F.linear
    calls = []

    def exact(x, w, b=None):  # integer-valued operands, sums far below 2^24: exact in any order
        return real((x * 4).round(), w.round())

    def flaky(x, w, b=None):
        y = exact(x, w)
        if x.dim() == 2 and x.shape[0] == 1 and x.storage_offset() == 42 * x.shape[1]:
            calls.append(1)
            y = y.clone()
            y[0, 0] = torch.nextafter(y[0, 0], torch.tensor(float("inf"), dtype=y.dtype))
        return y

    w = torch.randn(48, 64) * 4
    monkeypatch.setattr(bi.F, "linear", exact)
    assert bi._invariant(w, None, ("plain", 1))
    monkeypatch.setattr(bi.F, "linear", flaky)
    assert not bi._invariant(w, None, ("plain", 1))
    assert calls
    assert bi._invariant(w, None, ("blocked", bi.BLOCK_ROWS))  # 16-row calls never see row 42 alone
