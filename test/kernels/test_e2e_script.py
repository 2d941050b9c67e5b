"""benchmark/gpu/e2e_8b.py: its CPU path (--dry-run, a tiny random model) runs every stage the GPU
run will (dummy weights, triton backend, graph replays through the stand-in graph) and reports."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from kernel_inputs import TRITON_MISSING  # noqa: F401  (skips this module without triton)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmark" / "gpu" / "e2e_8b.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_dry_run_compares_modes_and_replays_graphs(tmp_path):
    spec = importlib.util.spec_from_file_location("e2e_8b", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--dry-run", "--out", str(tmp_path / "e2e"), "--modes", "vericache"]) == 0
    result = json.loads((tmp_path / "e2e.json").read_text())
    assert result["dry_run"] and list(result["modes"]) == ["full", "vericache"]
    full, vc = result["modes"]["full"], result["modes"]["vericache"]
    assert full["equals_full"] is True and vc["equals_full"] is True
    bs, _, new, _, _ = result["workload"]
    assert full["graph_replays"] == {"DECODE@4": new - 1}  # every decode step of the 3 requests, padded to 4
    assert set(vc["graph_replays"]) <= {"DRAFT_DECODE@1", "DRAFT_DECODE@2", "DRAFT_DECODE@4"}
    assert vc["graph_replays"]["DRAFT_DECODE@4"] > 0 and vc["tokens_per_round"] >= 1
    assert full["graph_failures"] == [] and vc["graph_failures"] == []
    table = (tmp_path / "e2e.md").read_text()
    assert "| full | " in table and "| vericache | " in table and "| yes |" in table
    assert bs == 3


DEVICE_RUN = SCRIPT.parent / "device_run.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_placement_dry_run_full_against_vc_auto_under_a_device_budget(tmp_path):
    """device_run.sh's placement stage (e2e_8b.py --placement) on the CPU: the budget holds one
    request's exact KV, vc-auto's tokens equal full's, and the script parses with the stage listed."""
    import subprocess

    assert subprocess.run(["bash", "-n", str(DEVICE_RUN)]).returncode == 0
    assert "placement) $PY benchmark/gpu/e2e_8b.py --placement" in DEVICE_RUN.read_text()
    spec = importlib.util.spec_from_file_location("e2e_8b", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--dry-run", "--placement", "--out", str(tmp_path / "place")]) == 0
    result = json.loads((tmp_path / "place.json").read_text())
    assert list(result["modes"]) == ["full", "vc-auto"] and result["placement_fits"] == 1
    full, auto = result["modes"]["full"], result["modes"]["vc-auto"]
    assert auto["equals_full"] is True
    assert full["placement"]["device_kv_budget"] == auto["placement"]["device_kv_budget"]
    assert "link_bandwidth" in auto["placement"] and "link_bandwidth" not in full["placement"]
    assert "| vc-auto | " in (tmp_path / "place.md").read_text()
