"""The CPU's measured figures and a profile fitted to timed forwards of the bundled model, for
benchmark/calibrate_cpu.py: DRAM read bandwidth and matmul throughput with torch (1 thread), and the
serial profile's unknowns fitted to decode, draft, verify and prefill forwards (thread CPU time)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_cost_model import GPU, CostModel, ModelShape, Work


def tiny_shape(model_path: str, dtype_bytes: int = 4, kv_dtype_bytes: int = 4) -> ModelShape:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return ModelShape(
        "vericache-code-tiny",
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        q_heads=cfg["num_attention_heads"],
        kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        intermediate=cfg["intermediate_size"],
        vocab=cfg["vocab_size"],
        tied_embeddings=cfg.get("tie_word_embeddings", False),
        dtype_bytes=dtype_bytes,
        kv_dtype_bytes=kv_dtype_bytes,
    )


def _best(f, n: int = 10) -> float:
    ts = []
    for _ in range(n):
        t = time.thread_time()
        f()
        ts.append(time.thread_time() - t)
    return min(ts)


def measure_machine() -> dict:
    import torch

    torch.set_num_threads(1)
    x = torch.empty(64 * 2**20, dtype=torch.float32).normal_()  # 256 MB
    bw = x.numel() * 4 / _best(lambda: x.sum())
    a, w = torch.randn(2048, 256), torch.randn(768, 256)
    flops = 2 * 2048 * 256 * 768 / _best(lambda: torch.nn.functional.linear(a, w))
    return {"hbm_bw": bw, "flops": flops}


def time_forwards(model_path: str, kv_dtype: str, page: int = 32, ratio: float = 4.0) -> list[dict]:
    """Thread-CPU seconds of the bundled model's forwards, with each forward's Work (cost-model rows)."""
    import torch

    from sglang_vericache.model_executor.forward_batch import ForwardMode
    from sglang_vericache.model_executor.model_runner import ModelRunner
    from sglang_vericache.server_args import ServerArgs
    from sglang_vericache.testing.draft_batches import (
        DraftPool,
        compress_prefix,
        make_compressed_pool,
        prepare_draft_batch,
    )
    from sglang_vericache.testing.forward_batches import new_req, prepare_forward_batch

    torch.manual_seed(0)
    r = ModelRunner(
        ServerArgs(
            model_path=model_path,
            skip_tokenizer_init=True,
            dtype="float32",
            kv_cache_dtype=kv_dtype,
            page_size=page,
            max_total_tokens=12 * 2048,
            max_running_requests=12,
            num_threads=1,
        )
    )
    shape = tiny_shape(model_path, 4, 4 if kv_dtype == "float32" else 2)
    cm = CostModel(shape, GPU(), ratio)
    L, B = 1728, 9
    tok = lambda n: torch.randint(3, 6000, (n,)).tolist()
    reqs = [new_req(r) for _ in range(B)]
    out = []
    t = time.thread_time()
    r.forward(prepare_forward_batch(r, [reqs[0]], [tok(1600)], ForwardMode.EXTEND))
    w = Work(tokens=1600, keys=1600, qk=1600 * 1601 / 2, requests=1)
    out.append({"kind": "prefill 1600", "kv": kv_dtype, "seconds": time.thread_time() - t, "work": asdict(w)})
    r.forward(prepare_forward_batch(r, [reqs[0]], [tok(L - 1600)], ForwardMode.EXTEND))
    for q in reqs[1:]:
        r.forward(prepare_forward_batch(r, [q], [tok(L)], ForwardMode.EXTEND))
    base = [q.kv_len for q in reqs]

    def reset():
        for q, k in zip(reqs, base):
            q.kv_len = k

    def decode(b):
        reset()
        r.forward(prepare_forward_batch(r, reqs[:b], [[5]] * b, ForwardMode.DECODE))

    def verify(b, x=16):
        reset()
        r.forward(prepare_forward_batch(r, reqs[:b], [tok(x + 1)] * b, ForwardMode.EXTEND))

    for b in (1, 3, 9):
        w = Work()
        for _ in range(b):
            cm.full_row(w, L + 1)
        out.append(
            {
                "kind": f"decode B={b}",
                "kv": kv_dtype,
                "seconds": _best(lambda b=b: decode(b)),
                "work": asdict(w),
            }
        )
    for b in (1, 2):
        w = Work()
        for _ in range(b):
            cm.verify_row(w, L, 16, staged=False)
        out.append(
            {
                "kind": f"verify B={b} x=16",
                "kv": kv_dtype,
                "seconds": _best(lambda b=b: verify(b)),
                "work": asdict(w),
            }
        )
    cp = make_compressed_pool(r, "streamingllm", ratio, num_chunks=B * (L // page + 1))
    dr = [compress_prefix(r, cp, q, L // page) for q in reqs]
    pool = DraftPool(r, B * 8)
    steps = 4

    def draft(b):
        for d in dr[:b]:
            pool.free(d.draft_slots)
            d.draft_slots = []
        for _ in range(steps):
            r.forward(prepare_draft_batch(r, cp, dr[:b], [5] * b, pool))

    for b in (3, 9):
        w = Work()
        for j in range(steps):
            for _ in range(b):
                cm.draft_row(w, L, j, weight=1.0 / steps)
        out.append(
            {
                "kind": f"draft B={b}",
                "kv": kv_dtype,
                "seconds": _best(lambda b=b: draft(b)) / steps,
                "work": asdict(w),
            }
        )
    return out


UNKNOWNS = ("per_forward_s", "per_request_s", "draft_overhead_s", "1/kv_bw", "1/attn_flops")


def _features(shape: ModelShape, w: Work) -> list[float]:
    return [
        1.0,
        w.requests,
        1.0 if w.drafts else 0.0,
        w.keys * shape.kv_bytes_per_token,
        w.qk * shape.qk_flops,
    ]


def fit_profile(samples: list[dict], machine: dict, model_path: str) -> tuple[GPU, dict]:
    """Least squares for UNKNOWNS on t - (weights or matmul) - staged copies, relative residuals."""
    import numpy as np

    rows, ys, known = [], [], []
    for s in samples:
        shape = tiny_shape(model_path, 4, 4 if s["kv"] == "float32" else 2)
        w = Work(**s["work"])
        k = max(shape.weight_bytes / machine["hbm_bw"], shape.row_flops * w.tokens / machine["flops"])
        rows.append([f / s["seconds"] for f in _features(shape, w)])  # relative: each point weighs alike
        ys.append((s["seconds"] - k) / s["seconds"])
        known.append(k)
    coef = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)[0]
    coef = np.maximum(coef, 1e-15)
    prof = GPU(
        name="CPU (this machine)",
        hbm_bytes=0.0,
        mem_fraction=1.0,
        hbm_bw=machine["hbm_bw"],
        flops=machine["flops"],
        serial=True,
        per_forward_s=float(coef[0]),
        per_request_s=float(coef[1]),
        draft_overhead_s=float(coef[2]),
        kv_bw=float(1 / coef[3]),
        attn_flops=float(1 / coef[4]),
    )
    points = []
    for s in samples:
        shape = tiny_shape(model_path, 4, 4 if s["kv"] == "float32" else 2)
        pred = CostModel(shape, prof, 4.0).time(Work(**s["work"])).total_s
        points.append(
            {
                "kind": s["kind"],
                "kv": s["kv"],
                "measured_ms": s["seconds"] * 1e3,
                "predicted_ms": pred * 1e3,
                "rel_err": pred / s["seconds"] - 1,
            }
        )
    errs = [abs(p["rel_err"]) for p in points]
    return prof, {
        "points": len(points),
        "unknowns": list(UNKNOWNS),
        "samples": points,
        "mean_abs_rel_err": statistics.mean(errs),
        "max_abs_rel_err": max(errs),
    }
