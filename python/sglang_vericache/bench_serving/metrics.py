"""The benchmark's figures (sglang.bench_serving's BenchmarkMetrics, its names and units) and the
"Serving Benchmark Result" block that prints them."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from sglang_vericache.bench_serving.backends import RequestFuncOutput

PERCENTILES = (90, 95, 99)


@dataclass
class BenchmarkMetrics:
    completed: int
    total_input: int
    total_output: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p90_ttft_ms: float
    p95_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p90_tpot_ms: float
    p95_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p90_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    std_e2e_latency_ms: float
    p90_e2e_latency_ms: float
    p95_e2e_latency_ms: float
    p99_e2e_latency_ms: float
    concurrency: float
    max_output_tokens_per_s: float = 0.0
    max_concurrent_requests: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _stats(name: str, values: list[float]) -> dict[str, float]:
    """mean, median, std and percentiles of values, in ms (0 when there are none, as sglang)."""
    v = np.asarray(values or [0.0], dtype=np.float64) * 1000
    out = {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(v.std())}
    out.update({f"p{p}_{name}_ms": float(np.percentile(v, p)) for p in PERCENTILES})
    return out


def _peaks(outputs: list[RequestFuncOutput]) -> tuple[float, int]:
    """Most output tokens in one wall-clock second, and most requests in flight in one."""
    ok = [o for o in outputs if o.success]
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    seconds = int(np.ceil(max(o.start_time + o.latency for o in ok) - t0)) + 1
    tokens, running = np.zeros(seconds), np.zeros(seconds)
    for o in ok:
        t = o.start_time + o.ttft
        times = [t]
        for gap in o.itl:
            t += gap
            times.append(t)
        for tt in times:
            tokens[min(int(tt - t0), seconds - 1)] += 1
        running[int(o.start_time - t0):int(o.start_time + o.latency - t0) + 1] += 1
    return float(tokens.max()), int(running.max())


def calculate_metrics(outputs: list[RequestFuncOutput], dur_s: float) -> BenchmarkMetrics:
    """Token counts are the server's (meta_info / usage) for every successful request."""
    ok = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_len for o in ok)
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    itls = [gap for o in ok for gap in o.itl]
    e2e = [o.latency for o in ok]
    peak_tokens, peak_requests = _peaks(outputs)
    itl_stats = _stats("itl", itls)
    return BenchmarkMetrics(
        completed=len(ok),
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(ok) / dur_s,
        input_throughput=total_input / dur_s,
        output_throughput=total_output / dur_s,
        total_throughput=(total_input + total_output) / dur_s,
        **_stats("ttft", [o.ttft for o in ok]),
        **_stats("tpot", tpots),
        **itl_stats,
        max_itl_ms=float(max(itls, default=0.0) * 1000),
        **_stats("e2e_latency", e2e),
        concurrency=sum(e2e) / dur_s,
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_requests,
    )


def _row(label: str, value, fmt: str = "") -> str:
    return "{:<40} {:<10{}}".format(label, value, fmt)


def summary_lines(backend: str, request_rate: float, max_concurrency: int | None, m: BenchmarkMetrics,
                  duration: float, accept_length: float | None) -> list[str]:
    """sglang.bench_serving's result block, row for row (less its retokenized and vision rows)."""
    f = ".2f"
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _row("Backend:", backend),
             _row("Traffic request rate:", request_rate),
             _row("Max request concurrency:", max_concurrency if max_concurrency else "not set"),
             _row("Successful requests:", m.completed),
             _row("Benchmark duration (s):", duration, f),
             _row("Total input tokens:", m.total_input),
             _row("Total generated tokens:", m.total_output),
             _row("Request throughput (req/s):", m.request_throughput, f),
             _row("Input token throughput (tok/s):", m.input_throughput, f),
             _row("Output token throughput (tok/s):", m.output_throughput, f),
             _row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, f),
             _row("Peak concurrent requests:", m.max_concurrent_requests),
             _row("Total token throughput (tok/s):", m.total_throughput, f),
             _row("Concurrency:", m.concurrency, f)]
    if accept_length:
        lines.append(_row("Accept length:", accept_length, f))
    sections = (("End-to-End Latency", "e2e_latency", "E2E Latency"), ("Time to First Token", "ttft", "TTFT"),
                ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"), ("Inter-Token Latency", "itl", "ITL"))
    d = m.as_dict()
    for title, key, short in sections:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append(_row(f"Mean {short} (ms):", d[f"mean_{key}_ms"], f))
        lines.append(_row(f"Median {short} (ms):", d[f"median_{key}_ms"], f))
        for p in PERCENTILES:
            lines.append(_row(f"P{p} {short} (ms):", d[f"p{p}_{key}_ms"], f))
    lines.append(_row("Max ITL (ms):", m.max_itl_ms, f))
    lines.append("=" * 50)
    return lines
