"""Our GGUF weights vs transformers' conversion of the same file: every (HF name, tensor) our loader yields
(model_loader/gguf_loader.py, float32) against a folder transformers saved from it
(`AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)` then `save_pretrained`, float32). Needs no
model class of ours: the HF names are the saved folder's. Prints the tensors that differ (none expected).

    python benchmark/check_gguf_tensors.py --gguf /tmp/models/gemma-3-270m-q4_k_m.gguf --hf /tmp/models/gemma3-hf
"""

from __future__ import annotations

import argparse
import glob
import os
import time

import torch
from safetensors import safe_open
from transformers import AutoConfig

from sglang_vericache.model_loader.gguf_loader import iterate_gguf
from sglang_vericache.utils.gguf_files import ensure_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, help="the .gguf file")
    ap.add_argument("--hf", required=True, help="transformers' float32 conversion of it (a folder of *.safetensors)")
    args = ap.parse_args()

    ref = {}
    for path in sorted(glob.glob(os.path.join(args.hf, "*.safetensors"))):
        f = safe_open(path, "pt")
        ref.update({k: (f, k) for k in f.keys()})
    config = AutoConfig.from_pretrained(ensure_config(args.gguf))
    t0 = time.perf_counter()
    seen, differ = set(), []
    for name, w in iterate_gguf(args.gguf, list(ref), config):
        f, key = ref[name]
        expected = f.get_tensor(key)
        seen.add(name)
        if w.shape != expected.shape or not torch.equal(w, expected):
            diff = (w - expected).abs().max().item() if w.shape == expected.shape else f"shape {tuple(w.shape)}"
            differ.append((name, diff))
    missing = sorted(set(ref) - seen)
    print(f"{len(seen)} tensors compared in {time.perf_counter() - t0:.1f} s: {len(differ)} differ, "
          f"{len(missing)} of the folder's not produced")
    for name, diff in differ[:20]:
        print(f"  differs: {name} (max abs diff {diff})")
    for name in missing[:20]:
        print(f"  not produced: {name}")
    raise SystemExit(1 if differ or missing else 0)


if __name__ == "__main__":
    main()
