"""benchmark/gpu/run_device_checks.py: its CPU path (--dry-run) runs, checks every kernel and
writes its report; the bandwidth section's bookkeeping works with the GPU timer stubbed out."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from kernel_inputs import TRITON_MISSING  # noqa: F401  (skips this module without triton)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmark" / "gpu" / "run_device_checks.py"
KERNELS = ["decode_exact", "decode_token_drop", "decode_int8", "decode_kivi4", "decode_kivi2"]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("run_device_checks", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_dry_run_checks_all_kernels_and_skips_gpu_timing(script, tmp_path):
    assert script.main(["--dry-run", "--out", str(tmp_path / "gpu_checks")]) == 0
    result = json.loads((tmp_path / "gpu_checks.json").read_text())
    checks = [c["check"] for c in result["correctness"]]
    assert checks == [
        "decode_exact",
        "verify",
        "decode_token_drop",
        "decode_int8",
        "decode_kivi4",
        "decode_kivi2",
        "quantize_append_int8",
        "quantize_append_kivi4",
        "quantize_append_kivi2",
    ]
    assert all(c["ok"] for c in result["correctness"])
    assert result["bandwidth"] == [] and "no CUDA" in result["bandwidth_skipped"]
    assert "Skipped: no CUDA" in (tmp_path / "gpu_checks.md").read_text()


def test_bandwidth_rows_count_the_bytes_each_kernel_reads(script, monkeypatch):
    monkeypatch.setattr(script, "_time_ms", lambda fn, dry: (fn(), 1.0)[1])  # run once, "1 ms"
    rows = script.check_bandwidth(script.TINY, "cpu", torch.Generator().manual_seed(0), True, math.inf)
    by_kernel = {r["kernel"]: r for r in rows}
    assert list(by_kernel)[:5] == KERNELS
    # exact: 2 requests x 64 tokens x (K and V: 2 heads x 16 dims x 4 bytes, + an 8-byte slot index)
    assert by_kernel["decode_exact"]["bytes"] == 2 * 64 * (2 * 2 * 16 * 4 + 8)
    assert by_kernel["decode_exact"]["fraction_of_peak"] == by_kernel["decode_exact"]["bytes"] / 1e-3 / 4.8e12
    # int8: 2 requests x 8 chunks of 8 tokens x 2 heads x (K, V: 16 codes + a 2-byte scale), 4-token exact
    # tails as above, and the [2, 8] int64 chunk-id table
    assert (
        by_kernel["decode_int8"]["bytes"] == 16 * 8 * 2 * 2 * (16 + 2) + 2 * 4 * (2 * 2 * 16 * 4 + 8) + 16 * 8
    )
    assert by_kernel["decode_kivi2"]["bytes"] < by_kernel["decode_kivi4"]["bytes"]
    assert {
        "verify_T4",
        "quantize_append_int8",
        "quantize_append_kivi4",
        "quantize_append_kivi2",
    } <= by_kernel.keys()
