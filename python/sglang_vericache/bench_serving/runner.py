"""One benchmark run: warmup, requests at Poisson arrivals under a concurrency cap, the summary,
and the JSON line appended to the output file (sglang.bench_serving's keys)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

import numpy as np
import requests
from tqdm.asyncio import tqdm

from sglang_vericache.bench_serving.backends import ASYNC_REQUEST_FUNCS, RequestFuncInput, RequestFuncOutput
from sglang_vericache.bench_serving.datasets import DatasetRow
from sglang_vericache.bench_serving.metrics import calculate_metrics, summary_lines

WARMUP_OUTPUT_LEN = 32  # sglang's: a warmup request generates at most this many tokens


async def get_request(rows: list[DatasetRow], request_rate: float) -> AsyncIterator[DatasetRow]:
    """Yields rows at Poisson arrivals of request_rate per second (inf: all at once)."""
    for row in rows:
        yield row
        if request_rate != float("inf"):
            await asyncio.sleep(np.random.exponential(1.0 / request_rate))


def server_accept_length(base_url: str, headers: dict[str, str]) -> float | None:
    """The server's mean VeriCache accept length (tokens per round), if it ran rounds."""
    try:
        info = requests.get(base_url + "/server_info", headers=headers, timeout=30).json()
    except (requests.RequestException, ValueError):
        return None
    state = (info.get("internal_states") or [{}])[0]
    extra = state.get("extra") or {}
    if extra.get("spec_rounds_total"):
        return extra.get("spec_accept_length")
    return state.get("avg_spec_accept_length")  # SGLang's servers


async def benchmark(args, rows: list[DatasetRow], model_id: str, base_url: str,
                    headers: dict[str, str]) -> dict:
    func, path = ASYNC_REQUEST_FUNCS[args.backend]
    api_url = base_url + path
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    def make_input(row: DatasetRow, output_len: int) -> RequestFuncInput:
        return RequestFuncInput(prompt=row.prompt, api_url=api_url, prompt_len=row.prompt_len,
                                output_len=output_len, model=model_id, extra_request_body=extra,
                                stream=not args.disable_stream, ignore_eos=not args.disable_ignore_eos,
                                temperature=args.temperature, headers=headers)

    async def limited(inp: RequestFuncInput, pbar) -> RequestFuncOutput:
        if semaphore is None:
            out = await func(inp)
        else:
            async with semaphore:
                out = await func(inp)
        if pbar is not None:
            pbar.update(1)
        return out

    if args.warmup_requests > 0:
        print(f"Starting warmup with {args.warmup_requests} sequences...")
        warm = make_input(rows[0], min(rows[0].output_len, WARMUP_OUTPUT_LEN))
        outs = await asyncio.gather(*(limited(warm, None) for _ in range(args.warmup_requests)))
        if not any(o.success for o in outs):
            raise RuntimeError(f"Warmup failed: check the benchmark's arguments. Error: {outs[0].error}")
        print(f"Warmup completed with {args.warmup_requests} sequences. Starting main benchmark run...")

    pbar = None if args.disable_tqdm else tqdm(total=len(rows))
    start = time.perf_counter()
    tasks = []
    async for row in get_request(rows, args.request_rate):
        tasks.append(asyncio.create_task(limited(make_input(row, row.output_len), pbar)))
    outputs: list[RequestFuncOutput] = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()

    metrics = calculate_metrics(outputs, duration)
    if metrics.completed == 0:
        first = next((o.error for o in outputs if o.error), "")
        print(f"All requests failed. First error:\n{first}")
    accept = server_accept_length(base_url, headers) if args.backend.startswith("sglang") else None
    print("\n" + "\n".join(summary_lines(args.backend, args.request_rate, args.max_concurrency, metrics,
                                         duration, accept)))
    m = metrics.as_dict()
    result = {
        "tag": args.tag,
        "backend": args.backend,
        "dataset_name": args.dataset_name,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "sharegpt_output_len": args.sharegpt_output_len,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "duration": duration,
        "completed": metrics.completed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        **{k: v for k, v in m.items() if k not in ("completed", "total_input", "total_output")},
        "accept_length": accept,
    }
    details = {
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_len if o.success else 0 for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    with open(args.output_file, "a") as f:
        f.write(json.dumps(result | details if args.output_details else result) + "\n")
    return result | details
