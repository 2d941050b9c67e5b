"""VeriCache round traces only (no full or lossy runs): a few lockstep runs per compressor, each
round's (drafted, accepted) recorded in bench_acceptance.py's row format, for
`project_gpu.py --acceptance FILE` when no bench_acceptance.py run of the model exists.

    .venv/bin/python benchmark/record_round_traces.py --model-path /path/to/SmolLM2-135M-Instruct \\
        --dtype bfloat16 --compressors snapkv kivi4 --out acceptance_traces_smollm2
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys


from common import RESULTS, code_prompts, machine, run_mode
from sglang_vericache.utils.hf_tokenizer import get_tokenizer
from sglang_vericache.server_args import QUANTIZING_COMPRESSORS, bundled_model_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="Checkpoint folder.")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                   help="Model and KV dtype (default: bfloat16).")
    p.add_argument("--compressors", nargs="+", default=["snapkv", "kivi4"], help="Compressors (default: snapkv kivi4).")
    p.add_argument("--ratio", type=float, default=4.0, help="Ratio of the token droppers (default: 4).")
    p.add_argument("--draft-tokens", type=int, default=16, help="Draft tokens per round X (default: 16).")
    p.add_argument("--num-prompts", type=int, default=4, help="Held-out code prompts (default: 4).")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=[256, 1024], metavar=("MIN", "MAX"),
                   help="Prompt length range in tokens (default: 256 1024).")
    p.add_argument("--max-new-tokens", type=int, default=64, help="Tokens per prompt (default: 64).")
    p.add_argument("--page-size", type=int, default=32, help="Page = compression chunk size (default: 32).")
    p.add_argument("--out", default="acceptance_traces", help="Results name under benchmark/results.")
    a = p.parse_args()
    tok = get_tokenizer(a.model_path)
    ids = [c.ids for c in code_prompts(tok, a.num_prompts, *a.prompt_tokens, model_path=bundled_model_path())]
    report = {"model_path": a.model_path, "machine": machine(), "command": shlex.join(["python", *sys.argv]),
              "args": vars(a), "prompt_tokens": [len(x) for x in ids], "rows": []}
    for comp in a.compressors:
        res = run_mode(a.model_path, ids, a.max_new_tokens, {"temperature": 0.0, "ignore_eos": True},
                       dtype=a.dtype, page_size=a.page_size, max_running_requests=len(ids), kv_compressor=comp,
                       kv_compression_ratio=a.ratio, speculative_algorithm="VERICACHE",
                       vericache_schedule="lockstep", speculative_num_draft_tokens=str(a.draft_tokens))
        m = res.metrics
        report["rows"].append({
            "compressor": comp, "ratio": None if comp in QUANTIZING_COMPRESSORS else a.ratio,
            "draft_tokens": a.draft_tokens, "rounds": m["spec_rounds"], "drafted": m["spec_drafted"],
            "accepted": m["spec_accepted"], "accept_length": (m["spec_accepted"] + m["spec_rounds"]) / max(m["spec_rounds"], 1),
            "accept_rate": m["spec_accepted"] / max(m["spec_drafted"], 1), "seconds": res.seconds,
            "round_trace": m["round_trace"]})
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{a.out}.json").write_text(json.dumps(report, indent=1))
        print(f"{comp}: {m['spec_rounds']} rounds, {report['rows'][-1]['accept_length']:.2f} tokens/round")


if __name__ == "__main__":
    main()
