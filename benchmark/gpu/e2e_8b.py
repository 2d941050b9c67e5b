"""full vs VeriCache vs lossy tokens/s for a random-weight model of Llama-3-8B's shape, one GPU.

Every mode runs in this process through the Scheduler (what launch_server runs) with
--load-format dummy (seeded random weights from a config.json written here: no checkpoint),
--attention-backend triton and CUDA graphs for decode and draft steps. Same prompts (random ids),
greedy, ignore_eos. Reported per mode: output tok/s over the run and over decoding alone (the run
less its prefill forwards), the prefill forwards' seconds, VeriCache's tokens per round, CUDA
graph replays, and whether the tokens equal full's. Exit status 1 if VeriCache's do not.

Here the exact KV of every mode but vc-auto-host is in GPU memory: what VeriCache gains is drafting's
smaller KV reads, not capacity. Random weights are not a trained
model: small-std random models often repeat one token, which drafts predict perfectly, so the
tokens per round measured here can be far above a real model's; it is reported as measured.

    python benchmark/gpu/e2e_8b.py             # GPU -> benchmark/results/gpu_e2e_8b.{json,md}
    python benchmark/gpu/e2e_8b.py --dry-run   # a tiny model on the CPU (TRITON_INTERPRET=1, ~1 min)

--placement: full against vc-auto under a device KV budget that holds PLACEMENT_FITS requests' exact
KV (full runs that many at a time; vc-auto keeps that much exact KV resident and streams the rest
over --link-bandwidth, PCIe Gen5's 55 GB/s by default) -> gpu_e2e_8b_placement.{json,md}. The
host tier's copies run on the side stream with events (mem_cache/copy_stream.py). vc-auto allocates its
exact pool on the device (the link is the throttle's emulation of PCIe over device-to-device gathers);
vc-auto-host (--exact-kv-pool host) keeps it in page-locked host memory, every forward reading exact KV
through an accelerator page cache of the budget's exact KV and one forward's pages (its page copies and
write-backs are synchronous copies on the compute stream in this first version).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT / "python", ROOT / "sgl-kernel-ext" / "python"):
    sys.path.insert(0, str(p))

from sglang_vericache.managers.scheduler import Scheduler  # noqa: E402
from sglang_vericache.mem_cache.device_page_cache import pages_one_forward_touches  # noqa: E402
from sglang_vericache.model_executor.cuda_graph_runner import CudaGraphRunner, EagerGraph  # noqa: E402
from sglang_vericache.server_args import ServerArgs  # noqa: E402
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion  # noqa: E402

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "initializer_range": 0.02,
    "bos_token_id": 128000, "eos_token_id": 128001,
}
TINY = {**LLAMA3_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        "rope_scaling": {**LLAMA3_8B["rope_scaling"], "original_max_position_embeddings": 256}}
# (batch, prompt tokens, new tokens, page size, dtype)
WORKLOAD = {"gpu": (16, 4096, 256, 16, "bfloat16"), "dry": (3, 40, 8, 8, "float32")}
PLACEMENT_FITS = {"gpu": 4, "dry": 1}  # --placement: requests whose exact KV the device budget holds
# The dry run drafts 2 tokens a round and warms up on 4: every kernel runs under the Triton interpreter
# (each launch ~1 ms of Python per program), and a random model accepts almost no draft, so a round of X
# drafts is X + 1 forwards per token there.
DRY_DRAFT_TOKENS, WARM_NEW_TOKENS = "2", {"gpu": 12, "dry": 4}
SNAPKV = {"kv_compressor": "snapkv", "kv_compression_ratio": 4.0}
MODES = {
    "full": {},
    # lock-step rounds (graph replays and tokens per round are checked); vc-auto: the default, adaptive
    "vericache": {**SNAPKV, "speculative_algorithm": "VERICACHE", "speculative_num_draft_tokens": "8",
                  "vericache_schedule": "lockstep"},
    "vc-auto": {**SNAPKV, "speculative_algorithm": "VERICACHE", "speculative_num_draft_tokens": "8"},
    # the same with the exact pool in page-locked host memory, read through the accelerator's page cache
    "vc-auto-host": {**SNAPKV, "speculative_algorithm": "VERICACHE", "speculative_num_draft_tokens": "8",
                     "exact_kv_pool": "host"},
    "lossy": SNAPKV,
}


def placement_args(config: dict, dry: bool, mode: str, link: str) -> dict:
    """--placement: a device KV budget of PLACEMENT_FITS requests' exact KV (whole pages, one spare);
    VeriCache streams what does not fit over `link`."""
    bs, prompt_len, new, page, dtype = WORKLOAD["dry" if dry else "gpu"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * (
        2 if dtype == "bfloat16" else 4)
    pages = -(-(prompt_len + new) // page) + 1
    budget_tokens = (PLACEMENT_FITS["dry" if dry else "gpu"] * pages + 1) * page
    out = {"device_kv_budget": str(budget_tokens * per_token)}
    if mode != "full":
        out["link_bandwidth"] = link
    if MODES[mode].get("exact_kv_pool") == "host":  # the cache: the budget's exact KV and one forward's pages
        forward = pages_one_forward_touches(ServerArgs.chunked_prefill_size, bs, page)
        out["exact_kv_cache_tokens"] = budget_tokens + forward * page
    return out


def run_mode(model_dir: str, mode: str, dry: bool, placement: dict | None = None) -> dict:
    bs, prompt_len, new, page, dtype = WORKLOAD["dry" if dry else "gpu"]
    server = dict(MODES[mode])
    if dry and "speculative_num_draft_tokens" in server:
        server["speculative_num_draft_tokens"] = DRY_DRAFT_TOKENS
    pool = {} if placement and mode == "full" else {"max_total_tokens": bs * (prompt_len + new + 2 * page) + 4096}
    sched = Scheduler(ServerArgs(
        model_path=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype=dtype,
        device="cuda" if HAS_CUDA else "cpu", attention_backend="triton", page_size=page,
        max_running_requests=bs, **pool, **(placement or {}),
        context_length=prompt_len + new + 64, chunked_prefill_size=max(prompt_len, 512), **server))
    runner = sched.model_runner
    if runner.graph_runner is None:  # the CPU: the runner's part through the stand-in graph
        runner.graph_runner = CudaGraphRunner(runner, capture_bs=[1, 2, 4], graph_factory=EagerGraph)
    vocab = runner.model_config.hf_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def batch(tag: str, n_prompt: int, n_new: int):
        return [make_request(f"{tag}{i}", torch.randint(3, vocab, (n_prompt,), generator=g).tolist(),
                             max_new_tokens=n_new, temperature=0.0, ignore_eos=True) for i in range(bs)]

    run_to_completion(sched, batch("warm", 2 * page + 3, WARM_NEW_TOKENS["dry" if dry else "gpu"]))  # Triton compiles, graphs captured
    sync = torch.cuda.synchronize if HAS_CUDA else (lambda: None)
    sync()
    sched.timeline = []  # (start, end, tag) of every forward
    runner.graph_runner.replay_counts.clear()  # count the timed run's replays only
    t0 = time.perf_counter()
    res = run_to_completion(sched, batch("r", prompt_len, new))
    sync()
    wall = time.perf_counter() - t0
    prefill_s = sum(b - a for a, b, tag in sched.timeline if tag == "prefill")
    outs = [res[f"r{i}"].output_ids for i in range(bs)]
    total = sum(len(o) for o in outs)
    decode_s = wall - prefill_s  # decoding and its scheduling: the run less its prefill forwards
    meta = [res[f"r{i}"].meta for i in range(bs)]
    rounds = sum(m.get("spec_rounds", 0) for m in meta)
    accepted = sum(m.get("spec_accepted_tokens", 0) for m in meta)
    return {
        "mode": mode, "outputs": outs, "wall_s": wall, "output_tok_s": total / wall,
        "decode_tok_s": (total - bs) / decode_s,
        "prefill_s": prefill_s,
        "tokens_per_round": (accepted + rounds) / rounds if rounds else None,
        "graph_replays": {f"{k[0]}@{k[1]}": v for k, v in runner.graph_runner.replay_counts.items()},
        "graph_failures": [list(map(str, k[:3])) for k in runner.graph_runner.failed],
        "max_resident": getattr(sched.spec_worker, "max_resident", None),  # adaptive: exact KV on the device
        "link_bytes": sched.link.engine.bytes_total if sched.link is not None else 0,
    }


def write_report(result: dict, prefix: Path) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(result, indent=2))
    bs, prompt_len, new, page, dtype = result["workload"]
    full = result["modes"]["full"]["output_tok_s"]
    lines = [
        f"# End to end, random-weight {result['model']} ({result['device']})", "",
        f"Made by `benchmark/gpu/e2e_8b.py{' --dry-run' if result['dry_run'] else ''}`; torch {result['torch']}; "
        f"{bs} requests x {prompt_len} prompt + {new} new tokens, greedy, {dtype}, page {page}, snapkv 4x, "
        f"X = {DRY_DRAFT_TOKENS if result['dry_run'] else 8}; triton backend, CUDA graphs; one run per mode."
        + ("" if not result.get("placement") else
           f" Placement: device KV budget {int(result['placement']['device_kv_budget']) / 1e6:.1f} MB "
           f"({result['placement_fits']} requests' exact KV), the rest streamed over "
           f"{result['link_bandwidth']}/s (emulated: the exact pool is on the device)."), "",
        "| mode | output tok/s | vs full | decode tok/s | prefill s | tokens/round | = full | graph replays |"
        + (" most resident | link MB |" if result.get("placement") else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if result.get("placement") else ""),
    ]
    for name, r in result["modes"].items():
        dec = f"{r['decode_tok_s']:.1f}"
        tpr = "" if r["tokens_per_round"] is None else f"{r['tokens_per_round']:.2f}"
        same = {True: "yes", False: "**no**", None: "(lossy)"}[r["equals_full"]]
        lines.append(f"| {name} | {r['output_tok_s']:.1f} | {r['output_tok_s'] / full:.2f}x | {dec} | "
                     f"{r['prefill_s']:.2f} | {tpr} | {same} | {sum(r['graph_replays'].values())} |"
                     + (f" {'-' if r['max_resident'] is None else r['max_resident']} | {r['link_bytes'] / 1e6:.1f} |"
                        if result.get("placement") else ""))
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny model (the CPU path; implied without CUDA)")
    ap.add_argument("--out", type=Path, default=None, help="output prefix (.json/.md are appended)")
    ap.add_argument("--modes", nargs="+", default=None, choices=list(MODES),
                    help="modes to run (default: all; with --placement: vc-auto); full always runs first")
    ap.add_argument("--placement", action="store_true",
                    help="full vs vc-auto under a device KV budget of PLACEMENT_FITS requests' exact KV, the rest "
                         "on the host tier (see the module help)")
    ap.add_argument("--link-bandwidth", default="55GB",
                    help="--placement: the host link VeriCache streams over, bytes/s (default PCIe Gen5's 55GB)")
    args = ap.parse_args(argv)
    dry = args.dry_run or not HAS_CUDA
    if args.modes is None:
        args.modes = ["vc-auto", "vc-auto-host"] if args.placement else [m for m in MODES if m != "vc-auto-host"]
    name = "gpu_e2e_8b_placement" if args.placement else "gpu_e2e_8b"
    prefix = args.out or (Path(f"/tmp/{name}_dryrun") if dry else ROOT / "benchmark/results" / name)
    modes = ["full"] + [m for m in args.modes if m != "full"]  # full first: the others compare to it
    with tempfile.TemporaryDirectory() as model_dir:
        config = TINY if dry else LLAMA3_8B
        Path(model_dir, "config.json").write_text(json.dumps(config))
        results, outputs = {}, {}
        for m in modes:
            place = placement_args(config, dry, m, args.link_bandwidth) if args.placement else None
            r = results[m] = run_mode(model_dir, m, dry, place)
            r["placement"] = place
            outputs[m] = r.pop("outputs")
            r["equals_full"] = None if m == "lossy" else outputs[m] == outputs["full"]
            print(f"{m:10s} {r['output_tok_s']:9.1f} tok/s  decode {r['decode_tok_s']:.1f}  "
                  f"= full: {r['equals_full']}  graphs {r['graph_replays']}", flush=True)
            if HAS_CUDA:
                torch.cuda.empty_cache()
    result = {
        "device": torch.cuda.get_device_name() if HAS_CUDA else f"CPU {platform.machine()} (TRITON_INTERPRET=1)",
        "model": "tiny llama (dry run)" if dry else "Llama-3-8B shape", "torch": torch.__version__,
        "dry_run": dry, "workload": WORKLOAD["dry" if dry else "gpu"], "modes": results,
    }
    if args.placement:
        result.update(placement=results[modes[-1]]["placement"], placement_fits=PLACEMENT_FITS["dry" if dry else "gpu"],
                      link_bandwidth=args.link_bandwidth)
    write_report(result, prefix)
    print(f"wrote {prefix.with_suffix('.json')} and {prefix.with_suffix('.md')}")
    return 0 if all(r["equals_full"] is not False for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
