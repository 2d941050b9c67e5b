"""Train KVzap's surrogate (compress/kvzap.py) for a checkpoint: collect our kvzip's scores on the
bundled model's own training text, fit a per-layer linear model and a 2-layer MLP from the layer's
hidden states to the log score, report both on held-out text, and save the better one as
<model>/kvzap/surrogate.safetensors (with kvzap/eval.json; beside a .gguf file: kvzap/<stem>.safetensors
and kvzap/<stem>.eval.json).

    PYTHONPATH=python .venv/bin/python recipes/kvzap/train.py                 # the served default model
    PYTHONPATH=python .venv/bin/python recipes/kvzap/train.py --model-path DIR --train-files 8

Data: the corpus manifest's train files (recipes/code_model; the stdlib of this machine's Python),
the first --tokens-per-file tokens of each file that long, prefilled in float32. The targets are the
scores kvzip ranks by at the serving scope (--scope; log, sinks excluded), per layer and KV head:
segment (the default, as --kv-compress-scope auto serves token droppers): each text is one segment,
replayed by kvzip's reconstruction passes in chunks of 2,048 tokens over all of it
(ReconstructionRunner.segment_passes, TwoTierKV.segment_reconstruction_scores); page: one pass per
page of --page-size tokens. The inputs are the hidden states entering each layer's attention.
Held-out: the manifest's held-out files (the benchmarks' prompts come from them). A checkpoint
without a manifest (a .gguf file) reads the bundled model's. Deterministic (--seed, 2 threads). CI
never runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch

from sglang_vericache.compress.base import KVZIP_CHUNK_TOKENS, surrogate_path
from sglang_vericache.compress.kvzap import KVzapSurrogate
from sglang_vericache.utils.hf_tokenizer import get_tokenizer
from sglang_vericache.compress.kvzip import reconstruction_scores
from sglang_vericache.model_executor.model_runner import ModelRunner
from sglang_vericache.compress.kvzip_reconstruction import ReconstructionRunner, repeat_prompts
from sglang_vericache.server_args import ServerArgs, bundled_model_path, default_model_path
from sglang_vericache.testing.forward_batches import new_req, prepare_forward_batch


def manifest_files(model_path: str, split: str) -> list[Path]:
    """The split's stdlib files from the checkpoint's corpus manifest, else the bundled model's (a
    checkpoint trained elsewhere, e.g. a .gguf file, gets the benchmarks' own train / held-out split)."""
    own = Path(model_path) / "corpus_manifest.json"
    manifest = json.loads((own if own.exists() else Path(bundled_model_path()) / "corpus_manifest.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [stdlib / f["path"] for f in manifest[split]["files"] if (stdlib / f["path"]).exists()]


class Collector:
    """Runs the checkpoint (float32, no scheduler) and turns a token sequence into per-unit (a
    segment: the whole sequence; else a page) hidden states, log kvzip scores and sink mask."""

    def __init__(self, model_path: str, page_size: int, segment: bool, num_sink_tokens: int = 4, tokenizer=None):
        # kv_compressor kvzip: the runner keeps room past the context for a segment's replay chunk.
        self.mr = ModelRunner(ServerArgs(model_path=model_path, dtype="float32", skip_tokenizer_init=True,
                                         page_size=page_size, max_running_requests=2, max_total_tokens=16384,
                                         kv_compressor="kvzip" if segment else None))
        self.page = page_size
        self.segment = segment
        self.sinks = num_sink_tokens
        self.rec = ReconstructionRunner(self.mr, page_size, repeat_prompts(tokenizer), num_sink_tokens,
                                        chunk_tokens=KVZIP_CHUNK_TOKENS if segment else None)
        mc = self.mr.model_config
        self.scale = mc.head_dim**-0.5

    def units(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids (a multiple of the page) -> X [P, T, L, hidden], y [P, T, L, H_kv] (log score), sink [P, T]:
        P pages of T = page_size tokens, or P = 1 segment of T = len(ids)."""
        mr, t = self.mr, self.page
        req = new_req(mr)
        fb = prepare_forward_batch(mr, [req], [ids], logits_indices=torch.empty(0, dtype=torch.int64))
        fb.captured_q = {}
        mr.capture_hidden = True
        try:
            mr.forward(fb)
        finally:
            mr.capture_hidden = False
        n_layers = mr.model_config.num_hidden_layers
        hidden = torch.stack([fb.captured_q[layer].float() for layer in range(n_layers)], dim=1)  # [N, L, hidden]
        slots = mr.req_to_token_pool.req_to_token[req.pool_idx, : len(ids)]
        pool = mr.token_to_kv_pool

        def scores(a: int, b: int, layers) -> torch.Tensor:  # keys [a, b) by their pass -> [b - a, L, H_kv]
            return torch.stack([reconstruction_scores(rec, pool.get_key_buffer(layer)[slots[a:b]], self.scale).t()
                                for layer, rec in enumerate(layers)], dim=1)

        if self.segment:
            ys = [torch.cat([scores(a, b, layers) for a, b, layers in self.rec.segment_passes(
                req.pool_idx, ids, 0, len(ids))])]
            t = len(ids)
        else:
            starts = list(range(0, len(ids), t))
            ys = [scores(s, s + t, layers) for s, layers in zip(starts, self.rec.passes(req.pool_idx, ids, starts))]
        mr.token_to_kv_pool_allocator.free(slots)
        mr.req_to_token_pool.free(req.pool_idx)
        y = torch.log(torch.stack(ys).clamp_min(1e-30))
        pos = torch.arange(len(ids)).view(-1, t)
        return hidden.view(len(ids) // t, t, n_layers, -1), y, pos < self.sinks


def collect(collector: Collector, tok, files: list[Path], tokens_per_file: int, label: str, limit: int):
    """The first `limit` files of at least tokens_per_file tokens."""
    xs, ys, sinks = [], [], []
    t0 = time.perf_counter()
    for i, path in enumerate(files):
        if len(xs) == limit:
            break
        ids = tok(path.read_text(errors="replace")).input_ids
        if len(ids) < tokens_per_file:  # one length for every text (as kvpress's KVzap data): the
            continue  # softmax denominators do not change with it
        ids = ids[: tokens_per_file // collector.page * collector.page]
        x, y, s = collector.units(ids)
        xs.append(x)
        ys.append(y)
        sinks.append(s)
        if len(xs) % 4 == 0:
            print(f"  {label}: {len(xs)}/{limit} files, {time.perf_counter() - t0:.0f} s", flush=True)
    return torch.cat(xs), torch.cat(ys), torch.cat(sinks)


def fit_linear(x: torch.Tensor, y: torch.Tensor, l2: float) -> KVzapSurrogate:
    """Per layer ridge regression, closed form: x [n, L, hidden], y [n, L, H]."""
    ws, bs = [], []
    for layer in range(x.shape[1]):
        xl, yl = x[:, layer].double(), y[:, layer].double()
        mx, my = xl.mean(0), yl.mean(0)
        xc, yc = xl - mx, yl - my
        a = xc.T @ xc + l2 * len(xl) * torch.eye(xl.shape[1], dtype=torch.float64)
        w = torch.linalg.solve(a, xc.T @ yc)
        ws.append(w.float())
        bs.append((my - mx @ w).float())
    return KVzapSurrogate({"w": torch.stack(ws), "b": torch.stack(bs)})


def fit_mlp(x, y, width: int, epochs: int, lr: float, seed: int, batch: int = 512) -> KVzapSurrogate:
    """Per layer GELU MLP (all layers trained at once, batched), MSE, AdamW, cosine schedule."""
    g = torch.Generator().manual_seed(seed)
    n, n_layers, d = x.shape
    h = y.shape[-1]
    w1 = (torch.randn(n_layers, d, width, generator=g) / math.sqrt(d)).requires_grad_()
    b1 = torch.zeros(n_layers, width, requires_grad=True)
    w2 = (torch.randn(n_layers, width, h, generator=g) / math.sqrt(width)).requires_grad_()
    b2 = y.mean(0).clone().requires_grad_()  # [L, H]
    params = [w1, b1, w2, b2]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    steps = epochs * max(1, n // batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    xt = x.transpose(0, 1)  # [L, n, d]
    yt = y.transpose(0, 1)
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        for i in range(0, n - batch + 1, batch):
            idx = order[i : i + batch]
            mid = torch.nn.functional.gelu(torch.bmm(xt[:, idx], w1) + b1[:, None])
            pred = torch.bmm(mid, w2) + b2[:, None]
            loss = torch.nn.functional.mse_loss(pred, yt[:, idx])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
    return KVzapSurrogate({"w1": w1.detach(), "b1": b1.detach(), "w2": w2.detach(), "b2": b2.detach()})


def predict_all(s: KVzapSurrogate, x: torch.Tensor) -> torch.Tensor:
    """x [..., L, hidden] -> [..., L, H]."""
    return torch.stack([s.predict(layer, x[..., layer, :]) for layer in range(x.shape[-2])], dim=-2)


def evaluate(s: KVzapSurrogate, x, y, sink, keep_ratio: float) -> dict:
    """On units (pages or segments) x [P, T, L, hidden], y [P, T, L, H]: per layer Pearson r of the log
    scores (sinks excluded), and the overlap of the kept sets (top T / keep_ratio per unit and head,
    sinks first, as the compressor keeps) of the surrogate's and kvzip's scores."""
    p, t, n_layers, h = y.shape
    pred = predict_all(s, x)
    free = ~sink[..., None, None].expand_as(y)
    r = []
    for layer in range(n_layers):
        a, b = pred[:, :, layer][free[:, :, layer]], y[:, :, layer][free[:, :, layer]]
        r.append(float(torch.corrcoef(torch.stack([a, b]))[0, 1]))
    k = max(1, int(t // keep_ratio))
    big = torch.finfo(torch.float32).max

    def kept(scores):  # [P, T, L, H] -> bool mask of the kept tokens
        scores = torch.where(sink[..., None, None], big, scores)
        top = scores.topk(k, dim=1).indices
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)

    kp, ky = kept(pred), kept(y)
    n_sink = sink.sum(1).float()[:, None, None]  # [P, 1, 1]: sinks are kept by both
    overlap = ((kp & ky).sum(1).float() - n_sink) / (k - n_sink)  # [P, L, H], the non-sink picks
    return {"pearson_r_per_layer": r, "pearson_r_mean": sum(r) / len(r),
            "topk_overlap_per_layer": overlap.mean(dim=(0, 2)).tolist(), "topk_overlap": float(overlap.mean()),
            "topk_overlap_random": float(((k - n_sink) / (t - n_sink)).mean()), "keep_ratio": keep_ratio, "pages": p}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=default_model_path(),
                    help="Checkpoint folder or .gguf file (default: the served default model, SmolLM2-135M-Instruct's "
                         "GGUF file).")
    ap.add_argument("--scope", choices=("segment", "page"), default="segment",
                    help="Which kvzip scores to learn: segment (each text one segment, as --kv-compress-scope auto "
                         "serves kvzip and kvzap) or page (each page of --page-size alone, --kv-compress-scope page).")
    ap.add_argument("--page-size", type=int, default=32, help="The KV page; --scope page: kvzip's scoring chunk.")
    ap.add_argument("--train-files", type=int, default=16,
                    help="Train-split files read (manifest order, those of at least --tokens-per-file tokens).")
    ap.add_argument("--heldout-files", type=int, default=4, help="Held-out files read for the report (likewise).")
    ap.add_argument("--tokens-per-file", type=int, default=None,
                    help="Leading tokens of each file used (default: 2048, one replay chunk, for --scope segment; "
                         "512 for page).")
    ap.add_argument("--mlp-width", type=int, default=64, help="The MLP's hidden width M.")
    ap.add_argument("--epochs", type=int, default=8, help="MLP epochs.")
    ap.add_argument("--lr", type=float, default=3e-3, help="MLP learning rate (AdamW, cosine).")
    ap.add_argument("--l2", type=float, default=1e-3, help="Ridge penalty of the linear model (per sample).")
    ap.add_argument("--keep-ratio", type=float, default=4.0, help="Ratio whose kept sets the report compares.")
    ap.add_argument("--seed", type=int, default=0, help="MLP initialisation and batch order.")
    ap.add_argument("--out", default=None, help="Surrogate file (default: where --kv-compressor kvzap looks: "
                    "<folder>/kvzap/surrogate.safetensors, or <dir>/kvzap/<stem>.safetensors beside a .gguf file).")
    args = ap.parse_args()
    if args.tokens_per_file is None:
        args.tokens_per_file = 2048 if args.scope == "segment" else 512
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    tok = get_tokenizer(args.model_path)
    t0 = time.perf_counter()
    col = Collector(args.model_path, args.page_size, args.scope == "segment", tokenizer=tok)
    train = collect(col, tok, manifest_files(args.model_path, "train"), args.tokens_per_file, "train",
                    args.train_files)
    held = collect(col, tok, manifest_files(args.model_path, "heldout"), args.tokens_per_file, "held-out",
                   args.heldout_files)
    collect_s = time.perf_counter() - t0
    x, y, sink = train
    free = ~sink.flatten()
    xf, yf = x.flatten(0, 1)[free], y.flatten(0, 1)[free]
    print(f"collected {len(xf)} train tokens ({x.shape[0]} {args.scope}s), {held[0].shape[0]} held-out {args.scope}s "
          f"in {collect_s:.0f} s", flush=True)
    t1 = time.perf_counter()
    models = {"linear": fit_linear(xf, yf, args.l2)}
    t2 = time.perf_counter()
    models["mlp"] = fit_mlp(xf, yf, args.mlp_width, args.epochs, args.lr, args.seed)
    t3 = time.perf_counter()
    report = {"model_path": args.model_path, "args": vars(args), "collect_seconds": collect_s,
              "fit_seconds": {"linear": t2 - t1, "mlp": t3 - t2}, "train_tokens": len(xf), "models": {}}
    for name, s in models.items():
        report["models"][name] = {"train": evaluate(s, x, y, sink, args.keep_ratio),
                                  "heldout": evaluate(s, *held, args.keep_ratio)}
        h = report["models"][name]["heldout"]
        print(f"{name}: held-out Pearson r {h['pearson_r_mean']:.3f}, top-{args.keep_ratio:g}x kept-set overlap "
              f"{h['topk_overlap']:.3f} (random {h['topk_overlap_random']:.3f})")
    best = max(models, key=lambda n: report["models"][n]["heldout"]["topk_overlap"])
    out = args.out or surrogate_path(args.model_path)
    if os.path.exists(out):  # the surrogate this run replaces, on the same held-out units
        h = report["replaced"] = evaluate(KVzapSurrogate.load(out), *held, args.keep_ratio)
        print(f"replaced surrogate: held-out Pearson r {h['pearson_r_mean']:.3f}, kept-set overlap {h['topk_overlap']:.3f}")
    report["shipped"] = best
    meta = {"kind": best, "scope": args.scope, "page_size": str(args.page_size), "heldout_topk_overlap":
            f"{report['models'][best]['heldout']['topk_overlap']:.4f}", "recipe": "recipes/kvzap/train.py"}
    models[best].save(out, metadata=meta)
    report["bytes"] = os.path.getsize(out)
    name = Path(out).name
    evals = Path(out).with_name("eval.json" if name == "surrogate.safetensors"
                                else name.replace(".safetensors", ".eval.json"))
    evals.write_text(json.dumps(report, indent=2))
    print(f"wrote {out} ({report['bytes']} bytes, {best}) and {evals}")


if __name__ == "__main__":
    sys.exit(main())
