"""Evaluate the trained model on the held-out files.

Writes eval.json (loss per token vs a unigram baseline, loss by position to 2048, ast.parse share of
greedy completions of 50 held-out function headers, samples), loss_curve.png, loss_by_position.png.
"""

from __future__ import annotations

import argparse
import ast
import csv
import hashlib
import json
import math
import textwrap
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from data import CHAT_USER_PROMPT, FunctionHeader, encode_documents, function_headers, load_split
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

WINDOW = 2048
BUCKETS = [(0, 64), (64, 128), (128, 256), (256, 512), (512, 1024), (1024, 1536), (1536, 2048)]


def heldout_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """Held-out files encoded exactly as in training ([<s>] + tokens + [</s>]) and concatenated."""
    return torch.tensor([t for doc in encode_documents(tok, texts, add_bos=True) for t in doc])


@torch.no_grad()
def position_losses(model: torch.nn.Module, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target losses of non-overlapping WINDOW-token windows: [n_windows, WINDOW - 1] losses
    (target position p + 1 predicted from positions 0..p) and the matching target ids."""
    n = stream.numel() // WINDOW
    windows = stream[: n * WINDOW].view(n, WINDOW)
    losses = []
    for w in windows:
        logits = model(input_ids=w[None]).logits[0, :-1].float()
        losses.append(torch.nn.functional.cross_entropy(logits, w[1:], reduction="none"))
    return torch.stack(losses), windows[:, 1:]


def unigram_losses(tok: Tokenizer, train: list[str], targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) under train-split token frequencies with add-one smoothing."""
    counts = torch.ones(tok.get_vocab_size(), dtype=torch.float64)
    for doc in encode_documents(tok, train, add_bos=True):
        counts += torch.bincount(torch.tensor(doc), minlength=counts.numel()).double()
    return -(counts / counts.sum()).log()[targets]


def cut_body(completion: str) -> tuple[str, bool]:
    """Cut a completion of a header that ends with its docstring's closing quotes (no newline: a
    prompt ending in a bare newline token is out of distribution for this tokenizer, whose tokens
    carry the next line's indentation).  Keeps the rest of that line and the body lines up to
    (excluding) the first non-empty line at column 0; says whether such a line was found."""
    first, *lines = completion.split("\n")
    kept = []
    for line in lines:
        if line.strip() and not line[0].isspace():
            return first + "\n" + "\n".join(kept).rstrip() + "\n", True
        kept.append(line)
    return first + "\n" + "\n".join(kept).rstrip() + "\n", False


def pick_headers(
    texts: list[str], paths: list[str], n: int, max_header_tokens: int, tok: Tokenizer
) -> list[FunctionHeader]:
    """n held-out functions, ordered by a hash of (path, name, line): deterministic, spread over files."""
    cands = [
        f
        for text, path in zip(texts, paths)
        for f in function_headers(text, path)
        if len(tok.encode(f.header).ids) <= max_header_tokens
    ]
    cands.sort(key=lambda f: hashlib.sha256(f"{f.path}:{f.name}:{f.lineno}".encode()).hexdigest())
    return cands[:n]


def parses(text: str) -> bool:
    try:
        ast.parse(text)
    except SyntaxError:  # includes IndentationError
        return False
    return True


@torch.no_grad()
def complete(model: torch.nn.Module, tok: Tokenizer, prompts: list[list[int]], max_new: int) -> list[str]:
    """Greedy completions of a left-padded batch, each decoded up to its first </s> or <|im_end|>."""
    pad, width = tok.token_to_id("<pad>"), max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    stops = [tok.token_to_id("</s>"), tok.token_to_id("<|im_end|>")]
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=pad,
    )
    texts = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stops), len(row))
        texts.append(tok.decode(row[:cut], skip_special_tokens=True))
    return texts


def plot_loss_curve(log_csv: Path, png: Path) -> None:
    rows = list(csv.DictReader(log_csv.open()))
    steps = [int(r["step"]) for r in rows]
    plt.figure(figsize=(6, 3.5))
    plt.plot(steps, [float(r["loss"]) for r in rows], lw=1.2)
    switch = next((int(r["step"]) for r in rows if r["seq_len"] != rows[0]["seq_len"]), None)
    if switch:
        plt.axvline(
            switch,
            color="gray",
            ls="--",
            lw=0.8,
            label=f"context {rows[0]['seq_len']} -> {rows[-1]['seq_len']}",
        )
        plt.legend()
    plt.xlabel("optimizer step")
    plt.ylabel("train loss (nats/token)")
    plt.yscale("log")
    plt.grid(alpha=0.3)
    plt.tight_layout()
    plt.savefig(png, dpi=110)
    plt.close()


def plot_by_position(per_pos: torch.Tensor, unigram: float, png: Path) -> None:
    k = 32  # moving average over k positions
    smooth = torch.nn.functional.avg_pool1d(per_pos[None, None], k, stride=1)[0, 0]
    plt.figure(figsize=(6, 3.5))
    plt.plot(
        range(k // 2 + 1, k // 2 + 1 + smooth.numel()),
        smooth.tolist(),
        lw=1.2,
        label=f"model ({k}-position mean)",
    )
    plt.axhline(unigram, color="gray", ls="--", lw=0.8, label="unigram baseline")
    plt.xlabel("position in 2048-token window")
    plt.ylabel("held-out loss (nats/token)")
    plt.xscale("log")
    plt.grid(alpha=0.3)
    plt.legend()
    plt.tight_layout()
    plt.savefig(png, dpi=110)
    plt.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("recipes/code_model/work"))
    ap.add_argument("--model", type=Path, default=None, help="defaults to <work>/model")
    ap.add_argument("--n-headers", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model or args.work / "model"
    out = args.work / "eval"
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    manifest = json.loads((args.work / "corpus_manifest.json").read_text())
    heldout, train = load_split(args.work, "heldout"), load_split(args.work, "train")

    stream = heldout_stream(tok, heldout)
    losses, targets = position_losses(model, stream)
    uni = unigram_losses(tok, train, targets)
    per_pos = losses.mean(0)
    n_bytes = sum(len(t.encode()) for t in heldout)
    loss = losses.mean().item()
    by_position = [
        {"positions": f"{a}-{b - 1}", "loss": round(losses[:, max(a - 1, 0) : b - 1].mean().item(), 4)}
        for a, b in BUCKETS
    ]  # column j of `losses` is the target at window position j + 1

    paths = [f["path"] for f in manifest["heldout"]["files"]]
    headers = pick_headers(heldout, paths, args.n_headers, max_header_tokens=512, tok=tok)
    bos = tok.token_to_id("<s>")
    chat_fn = headers[0]
    # Exactly what the tokenizer's chat template renders for this one user message.
    chat_prompt = f"<|im_start|>user\n{CHAT_USER_PROMPT}{chat_fn.header}<|im_end|>\n<|im_start|>assistant\n"
    prompts = [[bos] + tok.encode(fn.header.rstrip("\n"), add_special_tokens=False).ids for fn in headers]
    prompts.append(tok.encode(chat_prompt, add_special_tokens=False).ids)
    *completions, chat_reply = complete(model, tok, prompts, args.max_new_tokens)
    results = []
    for fn, completion in zip(headers, completions):
        tail, ended = cut_body(completion)
        body = tail.split("\n", 1)[1]
        text = textwrap.dedent(fn.header.rstrip("\n") + tail)
        ok = bool(body.strip()) and parses(text)  # an empty body is a failure
        results.append(
            {
                "path": fn.path,
                "name": fn.name,
                "lineno": fn.lineno,
                "ended": ended,
                "parses": ok,
                "header": fn.header,
                "completion": tail,
            }
        )

    report = {
        "model": str(model_dir),
        "heldout_files": len(heldout),
        "heldout_bytes": n_bytes,
        "heldout_tokens_scored": losses.numel(),
        "window": WINDOW,
        "loss_per_token": round(loss, 4),
        "unigram_loss_per_token": round(uni.mean().item(), 4),
        "perplexity": round(math.exp(loss), 2),
        "bits_per_byte": round(
            losses.sum().item() / math.log(2) / (n_bytes * losses.numel() / stream.numel()), 4
        ),
        "loss_by_position": by_position,
        "ast_parse": {
            "n": len(results),
            "parsed": sum(r["parses"] for r in results),
            "share": round(sum(r["parses"] for r in results) / max(1, len(results)), 3),
            "hit_token_cap": sum(not r["ended"] for r in results),
            "empty_body": sum(not r["completion"].split("\n", 1)[1].strip() for r in results),
            "max_new_tokens": args.max_new_tokens,
        },
        "completions": results,
        "chat_sample": {"prompt": chat_prompt, "reply": chat_reply},
        "eval_seconds": round(time.time() - start, 1),
    }
    (out / "eval.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_by_position(per_pos, report["unigram_loss_per_token"], out / "loss_by_position.png")
    if (args.work / "train_log.csv").exists():
        plot_loss_curve(args.work / "train_log.csv", out / "loss_curve.png")
    print(json.dumps({k: v for k, v in report.items() if k not in ("completions", "chat_sample")}, indent=1))


if __name__ == "__main__":
    main()
