"""A serving benchmark client with sglang.bench_serving's main flags and output.

    python -m sglang_vericache.bench_serving --backend sglang --port 30000 \
        --dataset-name random --random-input-len 512 --random-output-len 128 --num-prompts 64

Sends --num-prompts requests (Poisson arrivals at --request-rate, at most --max-concurrency in
flight) to a running server's native /generate (--backend sglang) or OpenAI endpoints (sglang-oai:
/v1/completions, sglang-oai-chat: /v1/chat/completions), then prints SGLang's "Serving Benchmark
Result" block (throughputs; TTFT, TPOT, ITL and E2E latency percentiles; concurrency) and appends
one JSON line of it to --output-file. Only aiohttp, requests, numpy and tqdm are needed: prompts are
tokenized by the server (/v1/tokenize, /v1/detokenize) unless --tokenizer names a local one.

  cli.py       the flags and their checks; main()
  datasets.py  random and ShareGPT-format prompts; the tokenizers
  backends.py  one request per backend, timed (TTFT, inter-token latencies)
  metrics.py   the summary's figures and its printout
  runner.py    warmup, arrivals, concurrency, the result line
"""

from __future__ import annotations

from sglang_vericache.bench_serving.cli import main, make_parser, run_benchmark

__all__ = ["main", "make_parser", "run_benchmark"]
