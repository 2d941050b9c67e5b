"""Package the trained model into the sglang_vericache assets folder and write its model card."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors import safe_open

MODEL_FILES = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
]
EVAL_FILES = ["eval.json", "loss_curve.png", "loss_by_position.png"]
RECIPE_COMMAND = "PYTHON=.venv/bin/python bash recipes/code_model/run_all.sh"
MAX_SAMPLE_HEADER_LINES = 8  # the card shows the first completions whose header is this short


def fastest_rate(log_csv: Path, window: int = 100) -> tuple[float, str]:
    """Tokens/s over the fastest `window`-step stretch of train_log.csv at each sequence length (the
    stretches where the shared machine was quietest), and the stretch's step range."""
    import csv

    rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(log_csv.open())]
    best, where = 0.0, ""
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if b["step"] - a["step"] >= window and b["seq_len"] == a["seq_len"]:
                rate = (b["tokens"] - a["tokens"]) / (b["elapsed_s"] - a["elapsed_s"])
                if rate > best:
                    best, where = rate, f"steps {a['step']:.0f}-{b['step']:.0f}"
                break
    return best, where


def generation_config(cfg: dict, tok_cfg: dict) -> dict:
    # Greedy by default; stop at </s> and at <|im_end|> (end of a chat turn).
    tokens = json.loads((Path(tok_cfg["_dir"]) / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in tokens}
    return {
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": [cfg["eos_token_id"], ids["<|im_end|>"]],
        "pad_token_id": cfg["pad_token_id"],
        "do_sample": False,
        "max_new_tokens": 256,
    }


def fence(code: str) -> str:
    return "```python\n" + code.rstrip("\n") + "\n```"


def card(manifest: dict, stats: dict, ev: dict, cfg: dict, size_mb: float, rate: float, where: str) -> str:
    a = stats["args"]
    ap = ev["ast_parse"]
    pos_rows = "\n".join(f"| {b['positions']} | {b['loss']:.3f} |" for b in ev["loss_by_position"])
    samples = []
    short = [r for r in ev["completions"] if r["header"].count("\n") <= MAX_SAMPLE_HEADER_LINES]
    for r in short[:4]:
        verdict = "parses" if r["parses"] else "does not parse"
        end = "ended at a dedent or EOS" if r["ended"] else f"cut at {ap['max_new_tokens']} tokens"
        samples.append(
            f"**`{r['path']}` :: `{r['name']}`** ({end}, {verdict}). The prompt is everything up to and "
            f"including the docstring's closing quotes; the rest is the greedy completion:\n\n"
            f"{fence(r['header'].rstrip(chr(10)) + r['completion'])}"
        )
    minutes = stats["train_seconds"] / 60
    by_pos = {b["positions"]: b["loss"] for b in ev["loss_by_position"]}
    early, late = by_pos["64-127"], by_pos["1536-2047"]
    if late < early - 0.05:
        context_note = f"Loss keeps falling with position ({early:.2f} at 64-127, {late:.2f} at 1536-2047): the model uses long context."
    else:
        context_note = (
            f"Loss does not keep falling with position ({early:.2f} at 64-127, {late:.2f} at 1536-2047): at this "
            "budget the model uses little context beyond the first hundred or so tokens, though positions up "
            "to 2048 were trained and loss stays flat rather than blowing up there."
        )
    return f"""# vericache-code-tiny

A {stats["params"] / 1e6:.2f} M-parameter Llama-architecture code model trained from scratch on the
Python {manifest["python_version"]} standard library. It is the default model of
`python -m sglang_vericache.launch_server`: small enough to ship inside the package and to run on a
CPU, and trained on real code rather than random weights. It was trained on a very small CPU budget
(see Training and Limitations): it continues Python, badly; it is not a useful assistant.

## Corpus

- Source: the `.py` files of the standard library of CPython {manifest["python_version"]}
  (`sysconfig.get_paths()["stdlib"]`), sorted by relative path. Excluded: any path under
  {", ".join(f"`{d}/`" for d in manifest["excluded_dirs"])}; files named `{manifest["excluded_prefixes"][0]}*`;
  files over {manifest["max_bytes"]:,} bytes or not UTF-8.
- Split by a seeded hash of the relative path (seed {manifest["seed"]}, {manifest["heldout_per_mille"] / 10:.1f}% held out):
  **train {manifest["train"]["num_files"]} files ({manifest["train"]["num_bytes"]:,} bytes), held-out
  {manifest["heldout"]["num_files"]} files ({manifest["heldout"]["num_bytes"]:,} bytes)**. The exact file lists with
  sha256 are in [`corpus_manifest.json`](corpus_manifest.json).
- Training documents are the train files (`<s>` + text + `</s>`) plus ChatML examples built from
  {a["chat_per_mille"] / 10:.0f}% of the train split's documented functions (user: the function header, assistant: the
  whole function), so the chat format is in the training data. {stats["corpus_tokens_per_epoch"]:,} tokens per epoch.

## Tokenizer

Byte-level BPE (`tokenizers`), vocabulary {cfg["vocab_size"]}, trained on the train split only. Special tokens
`<pad>`=0, `<s>`=1 (BOS, prepended by the tokenizer), `</s>`=2 (EOS), `<|im_start|>`=3, `<|im_end|>`=4.
Decoding round-trips any text exactly. The chat template in `tokenizer_config.json` is ChatML:
`<|im_start|>{{role}}\\n{{content}}<|im_end|>\\n` per message, and `<|im_start|>assistant\\n` with
`add_generation_prompt`.

## Shape

| | |
|---|---|
| architecture | `LlamaForCausalLM` |
| parameters | {stats["params"]:,} (tied input/output embeddings) |
| layers | {cfg["num_hidden_layers"]} |
| hidden / intermediate | {cfg["hidden_size"]} / {cfg["intermediate_size"]} |
| query heads / KV heads / head dim | {cfg["num_attention_heads"]} / {cfg["num_key_value_heads"]} / {cfg["head_dim"]} (grouped-query attention) |
| position encoding | RoPE, theta {a["rope_theta"]:.0f} |
| context | trained at {a["seq_len"]}, last {a["long_frac"] * 100:.0f}% of steps at {a["long_seq_len"]}; `max_position_embeddings` {cfg["max_position_embeddings"]} |
| weights | bfloat16 safetensors, {size_mb:.1f} MB |

## Training

Recipe (from the repository root; deterministic given `--seed`, a fixed number of steps):

```bash
{RECIPE_COMMAND}
```

AdamW (betas 0.9/0.95, weight decay {a["weight_decay"]}), peak LR {a["lr"]}, {a["warmup"]} warmup steps then cosine
to {a["min_lr_frac"] * 100:.0f}% of peak, gradient clip 1.0, bf16 autocast with fp32 master weights,
{a["tokens_per_step"]:,} tokens per step, {stats["steps"]} steps: **{stats["tokens_seen"]:,} tokens seen
({stats["epochs"]:.2f} epochs)**. Final train loss {stats["final_loss"]:.3f}.

Training took **{minutes:.1f} minutes** on {stats["machine"]["threads"]} threads of an `{stats["machine"]["cpu"]}` CPU
(2 cores, AVX-512 BF16; torch {stats["machine"]["torch"]}, Python {stats["machine"]["python"]}). The
machine was shared with other jobs (this project's tests and benchmarks), so training averaged
{stats["tokens_seen"] / stats["train_seconds"]:,.0f} tokens/s; its fastest 100-step stretch ({where}) ran at
{rate:,.0f} tokens/s, i.e. about {stats["tokens_seen"] / rate / 60:.0f} minutes for this run on a quiet machine.

![training loss](loss_curve.png)

## Held-out evaluation

On the {ev["heldout_files"]} held-out files ({ev["heldout_tokens_scored"]:,} scored tokens, non-overlapping windows of {ev["window"]}):

| | loss per token (nats) |
|---|---|
| this model | **{ev["loss_per_token"]:.3f}** (perplexity {ev["perplexity"]}, ~{ev["bits_per_byte"]:.2f} bits/byte) |
| unigram baseline (train-split token frequencies, add-one) | {ev["unigram_loss_per_token"]:.3f} |

Loss by position in the 2048-token window (a window starts at an arbitrary point of the
concatenated held-out files, so early positions have little context):

| positions | loss |
|---|---|
{pos_rows}

![loss by position](loss_by_position.png)

### Completing held-out functions

{ap["n"]} held-out functions that have a docstring (chosen by a hash of path, name and line), prompted
with `<s>` + signature + docstring (up to its closing quotes, without the newline: this\ntokenizer's newline tokens carry the next line's indentation), greedy decoding, cut at the first non-empty line back at the
`def`'s indentation (or at {ap["max_new_tokens"]} new tokens; {ap["hit_token_cap"]} hit the cap). The header plus
the completed body is dedented and given to `ast.parse`; an empty body counts as a failure
({ap.get("empty_body", 0)} were empty):
**{ap["parsed"]} / {ap["n"]} parse ({ap["share"] * 100:.0f}%)**. Parsing is a syntax check, not a
correctness check; at this budget most bodies repeat a line until the token cap (see the samples).

Samples (the first {len(samples)} of the {ap["n"]} whose header has at most {MAX_SAMPLE_HEADER_LINES} lines, not cherry-picked;
all {ap["n"]} are in [`eval.json`](eval.json)):

{chr(10).join(samples)}

Chat (the same first header sent as one user message through the chat template; greedy reply up to
`<|im_end|>` or {ap["max_new_tokens"]} tokens){": only blank lines, the model has not learned the chat format at this budget" if not ev["chat_sample"]["reply"].strip() else ""}:

{fence(ev["chat_sample"]["reply"])}

## Limitations

{context_note}

Tiny model, tiny budget: {stats["tokens_seen"]:,} training tokens ({stats["epochs"]:.1f} epochs of a small corpus), so
its held-out loss is far above what a longer run of the same recipe reaches (raise `--steps`), greedy
decoding often repeats a line until the token cap, and its bodies are rarely correct. It has seen only
the standard library. Use it to exercise the serving engine, not to write code.
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("recipes/code_model/work"))
    ap.add_argument("--dest", type=Path, default=Path("python/sglang_vericache/assets/vericache-code-tiny"))
    args = ap.parse_args()
    model_dir, eval_dir = args.work / "model", args.work / "eval"
    args.dest.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        shutil.copyfile(model_dir / name, args.dest / name)
    for name in EVAL_FILES:
        shutil.copyfile(eval_dir / name, args.dest / name)
    shutil.copyfile(args.work / "corpus_manifest.json", args.dest / "corpus_manifest.json")
    cfg = json.loads((model_dir / "config.json").read_text())
    # Readers of the pre-`rope_parameters` layout (older transformers, other engines) look here.
    cfg.setdefault("rope_theta", cfg["rope_parameters"]["rope_theta"])
    (args.dest / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = generation_config(cfg, {"_dir": str(model_dir)})
    (args.dest / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    with safe_open(args.dest / "model.safetensors", "pt") as f:
        names = f.keys()
        dtypes = {str(f.get_slice(k).get_dtype()) for k in names}
    assert dtypes == {"BF16"}, dtypes
    size_mb = (args.dest / "model.safetensors").stat().st_size / 1e6
    manifest = json.loads((args.work / "corpus_manifest.json").read_text())
    stats = json.loads((args.work / "train_stats.json").read_text())
    ev = json.loads((eval_dir / "eval.json").read_text())
    rate, where = fastest_rate(args.work / "train_log.csv")
    (args.dest / "README.md").write_text(card(manifest, stats, ev, cfg, size_mb, rate, where))
    print(f"wrote {args.dest}")


if __name__ == "__main__":
    main()
