"""By-hand check (not a benchmark, not in CI): VeriCache at --tp-size 2 equals full mode at --tp-size 2
bitwise (tokens and logprobs) in bfloat16 under deterministic inference, for every compressor (or those
named), greedy and seeded, lock-step (and staggered over a 1 GB/s link for snapkv and int8), on a tiny
random qwen2 checkpoint (tied embeddings, vocabulary 515: padded vocabulary shards).

    PYTHONPATH=python:sgl-kernel-ext/python OMP_NUM_THREADS=1 .venv/bin/python benchmark/check_tp_compressors.py [NAMES]

NAMES: comma-separated (e.g. snapkv,int8,snapkv+kivi4); default: every registered compressor.
Prints one line per run: sampling, compressor, schedule, BITWISE or DIFF, VeriCache rounds, seconds.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from sglang_vericache.compress.registry import COMPRESSOR_NAMES
    from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
    from sglang_vericache.testing.tp_ranks import Job, TPRanks

    torch.set_num_threads(1)
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(COMPRESSOR_NAMES)
    path = make_random_checkpoint("qwen2", tempfile.mkdtemp(prefix="tp-check-"), vocab_size=515)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 37, 70)]
    base = dict(model_path=path, skip_tokenizer_init=True, max_total_tokens=2048, dtype="bfloat16", page_size=8,
                enable_deterministic_inference=True)
    ranks = TPRanks(2)
    diffs = 0
    try:
        for label, sampling in (("greedy", {"temperature": 0.0}),
                                ("seeded", {"temperature": 0.9, "top_p": 0.95, "top_k": 40})):
            full = ranks.run(Job(base, prompts, 12, sampling))
            for name in names:
                for schedule in ("lockstep", "staggered") if name in ("snapkv", "int8") else ("lockstep",):
                    t0 = time.time()
                    link = {"link_bandwidth": "1GB"} if schedule == "staggered" else {}
                    vc = ranks.run(Job({**base, "kv_compressor": name, "speculative_algorithm": "VERICACHE",
                                        "speculative_num_draft_tokens": "6", "vericache_schedule": schedule, **link},
                                       prompts, 12, sampling))
                    same = vc["output_ids"] == full["output_ids"] and vc["logprobs"] == full["logprobs"]
                    diffs += not same
                    rounds = sum(m.get("spec_rounds", 0) for m in vc["meta"])
                    print(label, name, schedule, "BITWISE" if same else "DIFF", "rounds", rounds,
                          round(time.time() - t0, 1), flush=True)
    finally:
        ranks.close()
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
