"""Train a small Llama (GQA, head_dim 64, RoPE) from scratch on the stdlib corpus.

Deterministic given --seed: fixed thread count, seeded init and data order, and a fixed number of
steps (never a wall-clock limit).  Tokens per step are constant; the last --long-frac of the steps
use --long-seq-len so positions up to 2048 are trained.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import platform
import subprocess
import time
from pathlib import Path

import torch
from data import chat_examples, encode_documents, epoch_batches, load_split
from tokenizers import Tokenizer
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM


def model_config(args: argparse.Namespace, tok: Tokenizer) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.kv_heads,
        head_dim=64,
        max_position_embeddings=2048,
        rope_theta=args.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("<pad>"),
        attention_bias=False,
        mlp_bias=False,
    )


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_frac."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


class Batches:
    """Endless deterministic stream of [micro_batch, seq_len] windows, epoch after epoch."""

    def __init__(self, docs: list[list[int]], seq_len: int, micro_batch: int, seed: int) -> None:
        self.docs, self.seq_len, self.micro_batch, self.seed = docs, seq_len, micro_batch, seed
        self.epoch, self.pos, self.windows = 0, 0, epoch_batches(docs, seq_len, 0, seed)

    def next(self) -> torch.Tensor:
        if self.pos + self.micro_batch > len(self.windows):
            self.epoch, self.pos = self.epoch + 1, 0
            self.windows = epoch_batches(self.docs, self.seq_len, self.epoch, self.seed)
        self.pos += self.micro_batch
        return self.windows[self.pos - self.micro_batch : self.pos]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("recipes/code_model/work"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--rope-theta", type=float, default=50000.0)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--tokens-per-step", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--long-seq-len", type=int, default=2048)
    ap.add_argument("--long-frac", type=float, default=0.2)
    ap.add_argument("--micro-tokens", type=int, default=4096, help="tokens per forward/backward")
    ap.add_argument("--lr", type=float, default=2.5e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--chat-per-mille", type=int, default=150)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--snapshot-every", type=int, default=100, help="bf16 snapshot to work/snapshot")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = args.work / "model"
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))

    train = load_split(args.work, "train")
    docs = encode_documents(tok, train, add_bos=True)
    docs += encode_documents(tok, chat_examples(train, args.seed, args.chat_per_mille), add_bos=False)
    corpus_tokens = sum(map(len, docs))

    config = model_config(args, tok)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f}M, corpus {corpus_tokens} tokens/epoch, {args.steps} steps")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=False,
    )
    long_from = int(args.steps * (1 - args.long_frac))
    streams = {
        L: Batches(docs, L, max(1, args.micro_tokens // L), args.seed)
        for L in (args.seq_len, args.long_seq_len)
    }

    log_path = args.work / "train_log.csv"
    log = csv.writer(log_file := log_path.open("w", newline=""))
    log.writerow(["step", "tokens", "seq_len", "loss", "lr", "elapsed_s"])
    model.train()
    start, tokens_seen, running = time.time(), 0, []
    for step in (bar := tqdm(range(args.steps), mininterval=5)):
        seq_len = args.long_seq_len if step >= long_from else args.seq_len
        stream = streams[seq_len]
        n_micro = max(1, args.tokens_per_step // (stream.micro_batch * seq_len))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        step_loss = 0.0
        for _ in range(n_micro):
            x = stream.next()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss = model(input_ids=x, labels=x).loss
            (loss / n_micro).backward()
            step_loss += loss.item() / n_micro
            tokens_seen += x.numel()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running.append(step_loss)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean = sum(running) / len(running)
            running = []
            elapsed = time.time() - start
            log.writerow(
                [step + 1, tokens_seen, seq_len, f"{mean:.4f}", f"{lr_at(step, args):.6g}", f"{elapsed:.1f}"]
            )
            log_file.flush()
            bar.set_postfix(loss=f"{mean:.3f}", tok_s=f"{tokens_seen / elapsed:.0f}")
        if args.snapshot_every and (step + 1) % args.snapshot_every == 0:
            # A copy, so master weights stay fp32; only for inspection, never for resuming.
            snap = LlamaForCausalLM(config)
            snap.load_state_dict(model.state_dict())
            snap.to(torch.bfloat16).save_pretrained(args.work / "snapshot", safe_serialization=True)
    train_seconds = time.time() - start
    log_file.close()

    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"  # older readers look for torch_dtype, newer ones for dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    model_name = next(
        (line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?"
    )
    stats = {
        "params": n_params,
        "steps": args.steps,
        "tokens_seen": tokens_seen,
        "corpus_tokens_per_epoch": corpus_tokens,
        "epochs": tokens_seen / corpus_tokens,
        "train_seconds": round(train_seconds, 1),
        "final_loss": float(f"{step_loss:.4f}"),
        "machine": {
            "cpu": model_name,
            "threads": args.threads,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    (args.work / "train_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
