"""benchmark/bench_schedule_policy.py on a tiny workload: both policies give the same outputs, and
lpm serves the shared prefixes from the radix cache where fcfs's interleaved admissions evict them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
import bench_schedule_policy as bench  # noqa: E402


def test_workload_interleaves_the_groups():
    prompts = bench.workload(groups=2, per_group=2, prefix_len=4, suffix_len=2)
    assert [p[:4] for p in prompts] == [prompts[0][:4], prompts[1][:4]] * 2
    assert prompts[0][:4] != prompts[1][:4]
    assert len({tuple(p) for p in prompts}) == 4 and all(len(p) == 6 for p in prompts)


def test_lpm_serves_each_groups_prefix_from_the_cache(default_model_dir):
    args = bench.parse_args([
        "--model-path", default_model_dir, "--groups", "4", "--per-group", "3", "--prefix-len", "64",
        "--suffix-len", "8", "--new-tokens", "4", "--page-size", "8", "--max-total-tokens", "256",
        "--max-running-requests", "2", "--repeats", "1",
    ])
    report = bench.run(args)
    rows = {r["policy"]: r for r in report["rows"]}
    assert report["prompt_tokens"] == 12 * 72
    assert rows["fcfs"]["outputs_equal_fcfs"] and rows["lpm"]["outputs_equal_fcfs"]
    # lpm: each group's first request prefills the 64-token prefix, the other two find it cached.
    assert rows["lpm"]["cached_tokens"] == 4 * 2 * 64
    # fcfs: two groups run at a time and the next two groups' requests (2 x 76 tokens) evict the
    # finished groups' prefixes from the 256-token pool before those groups come round again.
    assert (rows["fcfs"]["cached_tokens"], rows["fcfs"]["prefilled_tokens"]) == (0, 12 * 72)
    assert "| lpm |" in bench.table(report)
