"""Device checks for sgl-kernel-ext on one NVIDIA GPU (written for an H200, < 8 minutes).

1. Correctness at real shapes (Llama-3-8B attention: 32 q heads, 8 KV heads, head_dim 128, bf16):
   every kernel against its torch reference (sgl_kernel_ext.ref), quantize-and-append bit-exact.
2. Decode attention achieved HBM bandwidth (bytes the kernel must read / median time, L2 flushed
   between runs by triton.testing.do_bench) as a fraction of the H200's 4.8 TB/s, for exact,
   token-drop, int8, kivi4 and kivi2 KV; plus verify attention and quantize-and-append times.

    python benchmark/gpu/run_device_checks.py            # GPU, real shapes:
                                                         #   -> benchmark/results/gpu_device_checks.{json,md}
    python benchmark/gpu/run_device_checks.py --dry-run  # tiny shapes; on a CPU under TRITON_INTERPRET=1
                                                         #   (GPU timing skipped; writes to /tmp unless --out)
Needs only torch + triton (sgl-kernel-ext is put on sys.path from this checkout). Exit status 1
if any correctness check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "sgl-kernel-ext" / "python"))

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton
import triton.testing
from sgl_kernel_ext import (
    decode_attention,
    quantize_append,
    quantized_decode_attention,
    ref,
    token_drop_decode_attention,
    verify_attention,
)

PEAK_BW = 4.8e12  # H200 HBM3e, bytes/s
ATOL_BF16 = 2e-2
ATOL_F32 = 2e-5
REAL = {
    "hq": 32,
    "hkv": 8,
    "d": 128,
    "page": 16,
    "chunk": 64,
    "group_size": 32,
    "ratio": 4,
    "dtype": torch.bfloat16,
}
TINY = {
    "hq": 4,
    "hkv": 2,
    "d": 16,
    "page": 4,
    "chunk": 8,
    "group_size": 4,
    "ratio": 2,
    "dtype": torch.float32,
}


# ------------------------------------------------------------------ inputs


def paged_kv(seq_lens, s, dev, gen):
    """Random bf16/f32 KV in shuffled pages (page 0 = padding) + req_to_token [B, max_len]."""
    page = s["page"]
    pages = [(n + page - 1) // page for n in seq_lens]
    order = (torch.randperm(sum(pages), generator=gen) + 1).tolist()
    num_slots = (sum(pages) + 1) * page
    k = torch.randn((num_slots, s["hkv"], s["d"]), device=dev).to(s["dtype"])
    v = torch.randn((num_slots, s["hkv"], s["d"]), device=dev).to(s["dtype"])
    r2t = torch.zeros((len(seq_lens), max(seq_lens) + page), dtype=torch.int64)
    for b, n in enumerate(seq_lens):
        ids = torch.tensor([order.pop() for _ in range(pages[b])], dtype=torch.int64)
        r2t[b, :n] = (ids[:, None] * page + torch.arange(page)).flatten()[:n]
    return k, v, r2t.to(dev), torch.arange(len(seq_lens), device=dev)


def quantized_chunks(kind, num_chunks, s, dev, gen):
    """Pool buffers [num_chunks + 1, ...] of random chunks, built by the reference quantizers
    (bit-identical to sglang_vericache's compressors, see test/kernels/test_quantize_append.py)."""
    shape = (num_chunks + 1, s["chunk"], s["hkv"], s["d"])
    k = torch.randn(shape, device=dev) * 2
    v = torch.randn(shape, device=dev) * 2
    if kind == "int8":
        (kc, ks), (vc, vs) = ref.int8_quantize_ref(k), ref.int8_quantize_ref(v)
        return {"k": kc, "k_scale": ks, "v": vc, "v_scale": vs}
    gk, gv = min(s["group_size"], s["chunk"]), min(s["group_size"], s["d"])
    return ref.kivi_quantize_ref(k, v, int(kind[-1]), gk, gv)


def dequantized(kind, chunks, s):
    if kind == "int8":
        return ref.int8_dequant_ref(chunks["k"], chunks["k_scale"]), ref.int8_dequant_ref(
            chunks["v"], chunks["v_scale"]
        )
    gk, gv = min(s["group_size"], s["chunk"]), min(s["group_size"], s["d"])
    return ref.kivi_dequant_ref(chunks, int(kind[-1]), gk, gv)


def compressed_case(kind, seq_lens, s, dev, gen):
    """Requests whose whole chunks are compressed (shuffled chunk ids); the rest is the exact tail."""
    t = s["chunk"]
    nchunks = [n // t for n in seq_lens]
    total = sum(nchunks)
    k, v, r2t, rpi = paged_kv(seq_lens, s, dev, gen)
    if kind == "token_drop":
        rows = t // s["ratio"]
        shape = (total + 1, rows, s["hkv"], s["d"])
        chunks = {
            "k": torch.randn(shape, device=dev).to(s["dtype"]),
            "v": torch.randn(shape, device=dev).to(s["dtype"]),
        }
    else:
        chunks = quantized_chunks(kind, total, s, dev, gen)
    ids = torch.randperm(total, generator=gen) + 1
    chunk_ids = torch.zeros((len(seq_lens), max(1, max(nchunks))), dtype=torch.int64)
    at = 0
    for b, n in enumerate(nchunks):
        chunk_ids[b, :n] = ids[at : at + n]
        at += n
    nc = torch.tensor(nchunks)
    starts = nc * t
    tail = {
        "k_buffer": k,
        "v_buffer": v,
        "req_to_token": r2t,
        "req_pool_indices": rpi,
        "tail_starts": starts.to(dev),
        "tail_lens": (torch.tensor(seq_lens) - starts).to(dev),
    }
    return chunks, chunk_ids.to(dev), nc.to(dev), tail


def chunk_bytes(chunks, num_used):
    return num_used * sum(b[0].numel() * b.element_size() for b in chunks.values())


# ------------------------------------------------------------------ correctness


def _err(got, want):
    return float((got.float() - want.float()).abs().max())


def check_correctness(s, dev, gen, dry):
    d, hq = s["d"], s["hq"]
    atol = ATOL_F32 if s["dtype"] == torch.float32 else ATOL_BF16
    scale = d**-0.5
    lens = [5, 70, 1] if dry else [4097, 1000, 33, 2048]
    out = []

    k, v, r2t, rpi = paged_kv(lens, s, dev, gen)
    q = torch.randn((len(lens), hq, d), device=dev).to(s["dtype"])
    sl = torch.tensor(lens, device=dev)
    got = decode_attention(q, k, v, r2t, rpi, sl, scale)
    out.append(("decode_exact", _err(got, ref.decode_attention_ref(q, k, v, r2t, rpi, sl, scale)), atol))

    qlens = [5, 1, 3] if dry else [8, 5, 1]
    vlens = [70, 6, 3] if dry else [4097, 1000, 300]
    k, v, r2t, rpi = paged_kv(vlens, s, dev, gen)
    qv = torch.randn((len(vlens), max(qlens), hq, d), device=dev).to(s["dtype"])
    ql, sl = torch.tensor(qlens, device=dev), torch.tensor(vlens, device=dev)
    got = verify_attention(qv, ql, k, v, r2t, rpi, sl, scale)
    want = ref.verify_attention_ref(
        qv.cpu(), ql.cpu(), k.cpu(), v.cpu(), r2t.cpu(), rpi.cpu(), sl.cpu(), scale
    )
    out.append(("verify", _err(got.cpu(), want), atol))

    clens = [19, 5, 75] if dry else [4096 + 17, 1000, 64]
    for kind in ("token_drop", "int8", "kivi4", "kivi2"):
        chunks, cids, nc, tail = compressed_case(kind, clens, s, dev, gen)
        q = torch.randn((len(clens), hq, d), device=dev).to(s["dtype"])
        if kind == "token_drop":
            got = token_drop_decode_attention(
                q, chunks["k"], chunks["v"], cids, nc, *tail.values(), sm_scale=scale
            )
            ck, cv = chunks["k"], chunks["v"]
        else:
            got = quantized_decode_attention(q, kind, chunks, cids, nc, *tail.values(), sm_scale=scale)
            ck, cv = dequantized(kind, chunks, s)
        want = ref.compressed_decode_ref(q, ck, cv, cids, nc, *tail.values(), scale)
        out.append((f"decode_{kind}", _err(got, want), atol))

    for kind in ("int8", "kivi4", "kivi2"):
        n = 4 if dry else 64
        k, v, r2t, _ = paged_kv([n * s["chunk"]], s, dev, gen)
        k, v = k * 3, v * 3
        slots = r2t[0, : n * s["chunk"]].view(n, -1)  # chunk i = tokens [i*T, (i+1)*T) of one request
        if kind == "int8":
            (kc, ks), (vc, vs) = ref.int8_quantize_ref(k[slots]), ref.int8_quantize_ref(v[slots])
            want = {"k": kc, "k_scale": ks, "v": vc, "v_scale": vs}
        else:
            gk, gv = min(s["group_size"], s["chunk"]), min(s["group_size"], s["d"])
            want = ref.kivi_quantize_ref(k[slots], v[slots], int(kind[-1]), gk, gv)
        got = {
            name: torch.zeros((n + 1, *b.shape[1:]), dtype=b.dtype, device=dev) for name, b in want.items()
        }
        quantize_append(kind, k, v, slots, torch.arange(1, n + 1, device=dev), got)
        same = all(
            torch.equal(got[name][1:].view(torch.uint8), b.view(torch.uint8)) for name, b in want.items()
        )
        out.append((f"quantize_append_{kind}", 0.0 if same else float("inf"), 0.0))
    return [{"check": c, "max_abs_err": e, "atol": a, "ok": e <= a} for c, e, a in out]


# ------------------------------------------------------------------ bandwidth


def _time_ms(fn, dry):
    if dry:
        return triton.testing.do_bench(fn, warmup=1, rep=3, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def _row(kernel, batch, seq_len, nbytes, ms):
    bw = nbytes / (ms * 1e-3)
    return {
        "kernel": kernel,
        "batch": batch,
        "seq_len": seq_len,
        "bytes": nbytes,
        "ms": ms,
        "tb_per_s": bw / 1e12,
        "fraction_of_peak": bw / PEAK_BW,
    }


def check_bandwidth(s, dev, gen, dry, deadline):
    configs = [(2, 64)] if dry else [(1, 32768), (16, 8192), (64, 4096), (256, 2048)]
    elt = torch.empty((), dtype=s["dtype"]).element_size()
    kv_per_tok = 2 * s["hkv"] * s["d"] * elt
    rows = []
    for bs, seq in configs:
        for kind in ("exact", "token_drop", "int8", "kivi4", "kivi2"):
            if time.monotonic() > deadline:
                rows.append(
                    {"kernel": f"decode_{kind}", "batch": bs, "seq_len": seq, "skipped": "time budget spent"}
                )
                continue
            q = torch.randn((bs, s["hq"], s["d"]), device=dev).to(s["dtype"])
            if kind == "exact":
                k, v, r2t, rpi = paged_kv([seq] * bs, s, dev, gen)
                nbytes = bs * seq * (kv_per_tok + 8)  # KV + one int64 slot index per token
                fn = partial(decode_attention, q, k, v, r2t, rpi, torch.full((bs,), seq, device=dev))
            else:
                chunks, cids, nc, tail = compressed_case(kind, [seq + s["chunk"] // 2] * bs, s, dev, gen)
                tail_tok = int(tail["tail_lens"].sum())
                nbytes = chunk_bytes(chunks, int(nc.sum())) + tail_tok * (kv_per_tok + 8) + cids.numel() * 8
                if kind == "token_drop":
                    fn = partial(token_drop_decode_attention, q, chunks["k"], chunks["v"], cids, nc, **tail)
                else:
                    fn = partial(quantized_decode_attention, q, kind, chunks, cids, nc, **tail)
            rows.append(_row(f"decode_{kind}", bs, seq, nbytes, _time_ms(fn, dry)))
        if HAS_CUDA:
            torch.cuda.empty_cache()
    if time.monotonic() > deadline:
        return rows
    # verify (T drafts per request) and quantize-and-append: times, with the bytes they must move
    bs, seq, t = (2, 64, 4) if dry else (16, 8192, 8)
    k, v, r2t, rpi = paged_kv([seq] * bs, s, dev, gen)
    qv = torch.randn((bs, t, s["hq"], s["d"]), device=dev).to(s["dtype"])
    ql, sl = torch.full((bs,), t, device=dev), torch.full((bs,), seq, device=dev)
    fn = partial(verify_attention, qv, ql, k, v, r2t, rpi, sl)
    rows.append(_row(f"verify_T{t}", bs, seq, bs * seq * (kv_per_tok + 8), _time_ms(fn, dry)))
    n = 4 if dry else 1024
    k, v, r2t, _ = paged_kv([n * s["chunk"]], s, dev, gen)
    slots = r2t[0, : n * s["chunk"]].view(n, -1)
    ids = torch.arange(1, n + 1, device=dev)
    for kind in ("int8", "kivi4", "kivi2"):
        bufs = {name: torch.zeros_like(b) for name, b in quantized_chunks(kind, n, s, dev, gen).items()}
        nbytes = n * s["chunk"] * kv_per_tok + chunk_bytes(bufs, n)
        fn = partial(quantize_append, kind, k, v, slots, ids, bufs)
        rows.append(_row(f"quantize_append_{kind}", n, s["chunk"], nbytes, _time_ms(fn, dry)))
    return rows


# ------------------------------------------------------------------ report


def write_report(result, prefix: Path):
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# sgl-kernel-ext device checks ({result['device']})",
        "",
        (
            f"Made by `benchmark/gpu/run_device_checks.py{' --dry-run' if result['dry_run'] else ''}`; "
            f"torch {result['torch']}, triton {result['triton']}; {result['wall_s']:.0f} s."
        ),
        "",
        "## Correctness",
        "",
        "| check | max abs err | atol | ok |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {c['check']} | {c['max_abs_err']:.3g} | {c['atol']:g} | {'yes' if c['ok'] else '**NO**'} |"
        for c in result["correctness"]
    ]
    lines += ["", "## Bandwidth (fraction of 4.8 TB/s)", ""]
    if result["bandwidth_skipped"]:
        lines.append(f"Skipped: {result['bandwidth_skipped']}")
    else:
        lines += [
            "| kernel | batch | seq len | MB read+written | ms | TB/s | of peak |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in result["bandwidth"]:
            if "skipped" in r:
                lines.append(
                    f"| {r['kernel']} | {r['batch']} | {r['seq_len']} | skipped: {r['skipped']} | | | |"
                )
            else:
                lines.append(
                    f"| {r['kernel']} | {r['batch']} | {r['seq_len']} | {r['bytes'] / 1e6:.1f} | "
                    f"{r['ms']:.4f} | {r['tb_per_s']:.3f} | {r['fraction_of_peak']:.1%} |"
                )
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (the CPU path; implied without CUDA)")
    ap.add_argument("--out", type=Path, default=None, help="output prefix (.json/.md are appended)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting bandwidth runs after this")
    args = ap.parse_args(argv)
    start = time.monotonic()
    dry = args.dry_run or not HAS_CUDA
    if not HAS_CUDA:
        print(
            "no CUDA device: running the CPU path (tiny shapes under TRITON_INTERPRET=1); "
            "GPU bandwidth checks are skipped",
            flush=True,
        )
    prefix = args.out or (
        Path("/tmp/gpu_device_checks_dryrun") if dry else ROOT / "benchmark/results/gpu_device_checks"
    )
    dev = "cuda" if HAS_CUDA else "cpu"
    s = TINY if dry else REAL
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)  # host-side shuffles
    correctness = check_correctness(s, dev, gen, dry)
    for c in correctness:
        verdict = "ok" if c["ok"] else "FAIL"
        print(
            f"{c['check']:28s} max_abs_err {c['max_abs_err']:.3g} (atol {c['atol']:g}) {verdict}", flush=True
        )
    bw_skip = None if HAS_CUDA else "no CUDA device (CPU dry run): no GPU figures are measured"
    bandwidth = [] if bw_skip else check_bandwidth(s, dev, gen, dry, start + args.budget_s)
    for r in bandwidth:
        print(r, flush=True)
    device = torch.cuda.get_device_name() if HAS_CUDA else f"CPU {platform.machine()} (TRITON_INTERPRET=1)"
    result = {
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dry_run": dry,
        "shapes": {k: str(v) for k, v in s.items()},
        "correctness": correctness,
        "bandwidth": bandwidth,
        "bandwidth_skipped": bw_skip,
        "wall_s": time.monotonic() - start,
    }
    write_report(result, prefix)
    print(f"wrote {prefix.with_suffix('.json')} and {prefix.with_suffix('.md')}")
    return 0 if all(c["ok"] for c in correctness) else 1


if __name__ == "__main__":
    sys.exit(main())
