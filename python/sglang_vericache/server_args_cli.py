"""The command line of ServerArgs: every flag, its default and its help (`ServerArgs.add_cli_args`).

Flag names are SGLang's where the concept is the same; each flag's dest is the ServerArgs field of
the same name (ServerArgs.from_cli_args reads them back).
"""

from __future__ import annotations

import argparse

from sglang_vericache.server_args import (
    DISAGG_PREFILLS,
    DISAGG_ROLES,
    DTYPES,
    KV_STORE_KINDS,
    KV_STORE_TIERS,
    KV_MODES,
    SCHEDULE_POLICIES,
    ServerArgs,
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    d = ServerArgs.__dataclass_fields__
    add = parser.add_argument
    add("--model-path", type=str, default=None,
        help="Local Hugging Face model folder (config.json, *.safetensors, tokenizer files), or a GGUF file "
             "(or a folder holding one .gguf and no config.json): config, weights and tokenizer come from "
             "the file, converted once into ~/.cache/sglang_vericache/gguf/. Default: SmolLM2-135M-Instruct "
             "(a GGUF file), fetched by scripts/setup_cpu.sh into ~/.cache/sglang_vericache/models.")
    add("--tokenizer-path", type=str, default=None,
        help="Tokenizer folder or GGUF file (default: --model-path).")
    add("--load-format", type=str, default=d["load_format"].default,
        choices=("auto", "safetensors", "gguf", "dummy"),
        help="How weights are loaded: safetensors reads the folder's *.safetensors; gguf dequantizes a GGUF "
             "file into --dtype; auto is whichever --model-path holds; dummy draws seeded random weights "
             "from the config alone (--random-seed), to benchmark a model's shape without its checkpoint "
             "(pair with --skip-tokenizer-init or --tokenizer-path).")
    add("--served-model-name", type=str, default=None, help="Model name reported by /v1/models.")
    add("--skip-tokenizer-init", action="store_true",
        help="Do not load a tokenizer: requests carry input_ids and responses carry output_ids only.")
    add("--dtype", type=str, default=d["dtype"].default, choices=DTYPES,
        help="Weight and activation dtype ('auto' = the checkpoint's torch_dtype, float32 for float32 "
             "checkpoints; for GGUF: float32 if every weight is stored F32, else bfloat16).")
    add("--kv-cache-dtype", type=str, default=d["kv_cache_dtype"].default, choices=DTYPES,
        help="Dtype the exact KV is stored in ('auto' = --dtype). E.g. --dtype float32 --kv-cache-dtype "
             "bfloat16 computes in float32 over bfloat16 KV: half the KV memory and link bytes; every mode "
             "(full, VeriCache, lossy) reads the same rounded KV, so VeriCache stays identical to full.")
    add("--device", type=str, default=d["device"].default, help="Device to run on: cpu or cuda.")
    add("--context-length", type=int, default=None,
        help="Longest prompt + output a request may have (default: the model's max_position_embeddings).")
    add("--chat-template", type=str, default=None,
        help="A Jinja chat template file that overrides the tokenizer's own.")
    add("--host", type=str, default=d["host"].default, help="HTTP host to bind.")
    add("--port", type=int, default=d["port"].default, help="HTTP port to bind.")
    add("--api-key", type=str, default=None, help="Require 'Authorization: Bearer KEY' on every request.")
    add("--log-level", type=str, default=d["log_level"].default, help="Logging level.")
    add("--stream-interval", type=int, default=d["stream_interval"].default,
        help="Output tokens per streaming event (the first token and the finish are always sent at once).")
    add("--page-size", type=int, default=d["page_size"].default, help="Tokens per KV-cache page.")
    add("--max-total-tokens", type=int, default=None,
        help="Token slots in the exact KV pool (default: from --device-kv-budget in full mode or "
             "--host-kv-budget in two-tier modes, else a quarter of free RAM, at most 131072).")
    add("--max-running-requests", type=int, default=d["max_running_requests"].default,
        help="Most requests decoding at once.")
    add("--chunked-prefill-size", type=int, default=d["chunked_prefill_size"].default,
        help="Most prompt tokens one request prefills per forward pass (longer prompts are chunked).")
    add("--max-prefill-tokens", type=int, default=d["max_prefill_tokens"].default,
        help="Most prompt tokens in one prefill batch.")
    add("--disable-radix-cache", action="store_true", help="Do not share prefixes between requests.")
    add("--kv-mode", type=str, default=None, choices=KV_MODES,
        help="full: exact KV on the accelerator (the reference). offload: exact KV in host memory, streamed in "
             "every step. lossy: compressed KV only. vericache: draft over compressed KV, verify over exact KV "
             "(output = full's, bitwise). lossy and vericache need --kv-compressor. Default: full, or what "
             "--kv-compressor / --speculative-algorithm / --kv-offload imply.")
    add("--kv-compressor", type=str, default=None,
        help="KV compressor for the compressed tier: streamingllm, snapkv, pyramidkv, h2o, knorm, kivi2, "
             "kivi4, int8, fp8. Alone it serves from compressed KV (lossy); with "
             "--speculative-algorithm VERICACHE it drafts from it and verifies against exact KV.")
    add("--kv-compression-ratio", type=float, default=d["kv_compression_ratio"].default,
        help="Compression ratio of token-dropping compressors. Quantizers (kivi2, kivi4, int8, fp8) have "
             "the ratio of their bit width: with them this flag has no effect (a warning says so).")
    add("--kv-compress-scope", type=str, default=d["kv_compress_scope"].default,
        choices=("auto", "page", "segment"),
        help="What a token-dropping compressor ranks at once: page (each page alone, k of every page's tokens) "
             "or segment (a prompt's whole pages after its prefill, with its last queries in view, and generated "
             "tokens in segments past an exact recent window; one budget over the segment). auto: segment for "
             "token droppers (and DROP+QUANT) without a KV store, a dual-instance role or --speculative-ngram; "
             "page otherwise.")
    add("--kv-compress-segment-tokens", type=int, default=d["kv_compress_segment_tokens"].default,
        help="Segment scope: the longest segment in tokens (a longer prompt is folded in several; at most 32767).")
    add("--kv-recent-window", type=int, default=d["kv_recent_window"].default,
        help="Segment scope: generated tokens kept exact; past twice this, the older whole pages are folded as "
             "one segment, leaving this many exact.")
    add("--speculative-algorithm", type=str, default=None,
        help="VERICACHE: draft over the compressed KV, verify over the exact KV; output equals full KV.")
    add("--speculative-num-draft-tokens", type=str, default=d["speculative_num_draft_tokens"].default,
        help="Draft tokens per VeriCache round (1-64), or 'auto' to adapt per request to its acceptance.")
    add("--speculative-ngram", action="store_true",
        help="VeriCache: look each request's newest tokens up in its own prompt and output (an n-gram index) "
             "and let the compressed-KV drafter check the continuation found there, several tokens in one "
             "draft forward; it keeps the tokens it would have drafted one at a time anyway, so the drafts, "
             "the verification and the output are unchanged, with fewer draft forwards. Any checkpoint.")
    add("--speculative-ngram-min-match-window-size", type=int,
        default=d["speculative_ngram_min_match_window_size"].default,
        help="--speculative-ngram: the fewest newest tokens that must match earlier text to propose (1-64).")
    add("--speculative-ngram-max-match-window-size", type=int,
        default=d["speculative_ngram_max_match_window_size"].default,
        help="--speculative-ngram: the most newest tokens matched; the longest window that matches wins "
             "(1-64).")
    add("--speculative-ngram-branch-length", type=int, default=d["speculative_ngram_branch_length"].default,
        help="--speculative-ngram: the most proposal tokens one draft forward checks per request (1-64; also "
             "at most the round's drafts left less one). One chain per request (SGLang's BFS breadth 1).")
    add("--device-kv-budget", type=str, default=None,
        help="Accelerator memory for KV (e.g. 256MB). Full mode keeps exact KV here; VeriCache and lossy "
             "keep the compressed tier, exact tails and verification staging here. Per rank with --tp-size.")
    add("--host-kv-budget", type=str, default=None,
        help="Host memory for the exact KV tier in VeriCache mode (e.g. 4GB). Per rank with --tp-size.")
    add("--link-bandwidth", type=str, default=None,
        help="Throttle host->accelerator copies of exact KV (verification staging, offload) to this many "
             "bytes per second (e.g. 2GB = 2e9 B/s), so a CPU run has a real slow link. Default: unthrottled. "
             "With --tp-size, each rank has its own link (its KV heads' bytes).")
    add("--vericache-schedule", type=str, default=d["vericache_schedule"].default,
        choices=("adaptive", "auto", "lockstep", "staggered"),
        help="adaptive: per request, exact KV stays in device memory while the budget holds it, and a "
             "controller fitted to measured step costs picks decoding like full mode or VeriCache rounds (and "
             "their length) and admits host-tier requests only while they add throughput; lockstep: all "
             "requests draft, then all verify; staggered: each iteration some verify while the rest draft, "
             "booked against link bandwidth and staging memory (lockstep and staggered: fixed policies, for "
             "benchmarks); auto (default): adaptive, lockstep on a --disagg-role drafter and at --tp-size > 1.")
    add("--verify-staging-tokens", type=int, default=d["verify_staging_tokens"].default,
        help="Exact-KV rows (per layer, double-buffered) that streamed verification may stage on the "
             "accelerator; also the longest context a request may have when exact KV is streamed.")
    add("--kv-offload", action="store_true",
        help="Baseline: full mode with exact KV in host memory, streamed over the link at every step.")
    add("--exact-kv-pool", type=str, default=d["exact_kv_pool"].default, choices=["device", "host"],
        help="VeriCache and lossy modes: where the exact KV pool lives. device (default): accelerator memory "
             "(which requests count as resident is accounting); host: host memory (page-locked on CUDA), every "
             "committed token written through to it, forwards reading exact KV through an accelerator page cache "
             "(--exact-kv-cache-tokens) that keeps resident requests' pages and the others' tail pages.")
    add("--exact-kv-cache-tokens", type=int, default=None,
        help="With --exact-kv-pool host: tokens of exact KV the accelerator's page cache holds (default: what "
             "--device-kv-budget holds of it, else the whole pool).")
    add("--kv-store", type=str, default=d["kv_store"].default, choices=KV_STORE_KINDS,
        help="Keep prompt KV pages in a shared store that any instance can load prefixes from: file (a "
             "directory on this host), redis (a Redis server), none. Store trouble never fails a request: "
             "the prefix is recomputed.")
    add("--kv-store-path", type=str, default=None,
        help="Directory of the file KV store (default: $XDG_CACHE_HOME or ~/.cache, "
             "/sglang-vericache/kv-store).")
    add("--kv-store-url", type=str, default=d["kv_store_url"].default,
        help="Redis server of the redis KV store: redis://[:password@]HOST:PORT/DB, rediss://..., or unix://PATH.")
    add("--kv-store-capacity", type=str, default=None,
        help="Most bytes the KV store may hold (e.g. 20GB); least recently used pages are evicted. "
             "Default: unlimited.")
    add("--kv-store-bandwidth", type=str, default=None,
        help="Throttle KV store reads and writes to this many bytes/s (e.g. 1GB), modelling the link "
             "between this instance and the store. Default: unthrottled.")
    add("--kv-store-timeout", type=float, default=d["kv_store_timeout"].default,
        help="Seconds a KV store call may take before the store counts as down (it is then skipped, "
             "with a warning, and retried later).")
    add("--kv-store-tiers", type=str, default=d["kv_store_tiers"].default, choices=KV_STORE_TIERS,
        help="Which KV tiers go through the store: exact, compressed, both, or auto (exact in full mode, "
             "both in lossy and VeriCache modes).")
    add("--disagg-role", type=str, default=d["disagg_role"].default, choices=DISAGG_ROLES,
        help="Dual-instance VeriCache: 'drafter' serves clients and drafts over compressed KV, verifying on "
             "the verifier at --verifier-addr; 'verifier' holds exact KV and verifies drafters' runs "
             "(no HTTP server; listens on --host:--disagg-port). Start the verifier first.")
    add("--verifier-addr", type=str, default=None,
        help="Drafter: the verifier's ZMQ address, tcp://HOST:PORT.")
    add("--disagg-port", type=int, default=None, help="Verifier: the TCP port drafters connect to.")
    add("--disagg-prefill", type=str, default=d["disagg_prefill"].default, choices=DISAGG_PREFILLS,
        help="Drafter: who prefills a prompt. 'local': this instance (exact KV kept in its host tier). "
             "'verifier' (remote prefix caching): the drafter loads only the compressed pages of the prompt's "
             "prefix (from its cache or --kv-store, over its slow link); the verifier loads the exact prefix "
             "from its own store, prefills the rest, and returns the first token and the exact KV of the "
             "positions past the drafter's compressed pages.")
    add("--disagg-bandwidth", type=str, default=None,
        help="Drafter: bytes/s of its link to the verifier (e.g. 100MB); the exact KV the verifier sends "
             "(prefill and rounds) is delivered no sooner than that link allows. Equal to "
             "--kv-store-bandwidth, the store and the verifier share one link. Default: unthrottled.")
    add("--disagg-secret", type=str, default=None,
        help="Drafter and verifier: a shared secret; every frame between them then carries an HMAC-SHA256 "
             "under it, and frames without a valid one are dropped. Default: "
             "$SGLANG_VERICACHE_DISAGG_SECRET (preferred: a flag shows in the process list), else "
             "unauthenticated (the verifier then warns; keep its --host on loopback).")
    add("--disagg-timeout", type=float, default=d["disagg_timeout"].default,
        help="Seconds without an answer before the drafter fails the requests the verifier held (and "
             "without a message before the verifier drops a drafter's sessions).")
    add("--random-seed", type=int, default=d["random_seed"].default,
        help="Seed for the server's random choices (seeds of unseeded requests).")
    add("--enable-deterministic-inference", action=argparse.BooleanOptionalAction, default=None,
        help="Batch-invariant inference (the default): every token row is computed by the same arithmetic "
             "whatever shares its batch (linear layers as one float32 accumulation per output in a fixed "
             "order, attention reduced in fixed chunks of keys), so a prompt's output (tokens and logprobs) "
             "is the same alone or under load, chunked or not, cache hit or miss, and VeriCache / lossy "
             "output equals full mode's bitwise in every dtype. Default: on with the torch backend on a CPU "
             "and the triton backend on CUDA (Triton matmul and fixed-split attention; no CUDA graphs); off "
             "on flashinfer. Accepted for SGLang command lines; --disable-deterministic-inference (or "
             "--no-enable-deterministic-inference) turns it off.")
    add("--disable-deterministic-inference", dest="enable_deterministic_inference", action="store_const",
        const=False, default=None,
        help="Turn deterministic inference off (default: on, see --enable-deterministic-inference): library "
             "matrix products (and CUDA graphs), faster on some machines, but outputs may then change with "
             "batch composition and VeriCache / lossy output need not equal full mode's (a startup warning "
             "says so).")
    add("--attention-backend", type=str, default=d["attention_backend"].default,
        help="Attention backend: torch (reference, CPU and CUDA), triton (sgl-kernel-ext kernels; "
             "CUDA, or a CPU with TRITON_INTERPRET=1 for tests), flashinfer (NVIDIA GPU).")
    add("--num-threads", type=int, default=None, help="torch intra-op threads in the scheduler process.")
    add("--cpu-half-gemm", type=str, default=d["cpu_half_gemm"].default, choices=("auto", "native", "float32"),
        help="With deterministic inference off: how bfloat16 / float16 linear layers multiply on a CPU: "
             "native (torch's half GEMM); float32 "
             "(each weight also kept in float32, 4 more bytes per parameter; products accumulated in float32 "
             "and rounded once to the model dtype, 4-7x faster on CPUs without AVX512-BF16/AMX); auto "
             "(float32 on a CPU without half-precision dot products while the copies take under a quarter "
             "of free memory). Ignored under deterministic inference, whose kernel reads the weights in their "
             "own dtype.")
    add("--disable-cuda-graph", action="store_true",
        help="Run decode and draft steps eagerly. By default, on CUDA with --attention-backend triton, "
             "each batch size's DECODE / DRAFT_DECODE forward is captured as a CUDA graph on first use "
             "and replayed (batches padded up to the next captured size).")
    add("--cuda-graph-max-bs", type=int, default=None,
        help="Largest batch size captured (default: min(--max-running-requests, 64)); larger batches "
             "run eagerly. CUDA with --attention-backend triton only (elsewhere: a warning).")
    add("--cuda-graph-bs", type=int, nargs="+", default=None,
        help="The batch sizes captured (default: 1 2 4 8, then every 8 up to --cuda-graph-max-bs). CUDA "
             "with --attention-backend triton only (elsewhere: a warning).")
    add("--tool-call-parser", type=str, default=None,
        help="SGLang function-call parser for OpenAI tools (qwen25, llama3, mistral, pythonic, hermes, ...).")
    add("--reasoning-parser", type=str, default=None,
        help="SGLang reasoning parser (qwen3, deepseek-r1, ...): chat completions return the model's "
             "thinking as message.reasoning_content, apart from content (and in stream deltas).")
    add("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=d["tp_size"].default,
        help="Tensor parallel size: the model's attention heads (and both KV tiers, by KV head), MLP and "
             "vocabulary are split over this many scheduler processes, one per rank (gloo on a CPU, NCCL "
             "on CUDA: rank r on cuda:r). Must divide the heads, KV heads and intermediate size.")
    add("--dist-init-addr", type=str, default=None,
        help="HOST:PORT where the ranks meet (torch.distributed's TCP rendezvous, on node 0). Default "
             "with one node: a free port on 127.0.0.1. Needed with --nnodes > 1.")
    add("--nnodes", type=int, default=d["nnodes"].default,
        help="Number of hosts the --tp-size ranks are spread over (tp_size / nnodes ranks on each). Start "
             "launch_server on every host with the same flags and its own --node-rank.")
    add("--node-rank", type=int, default=d["node_rank"].default,
        help="This host's index in [0, --nnodes). Node 0 runs rank 0 and serves HTTP; the others run "
             "their ranks only, and exit when rank 0 does.")
    add("--dist-timeout", type=float, default=d["dist_timeout"].default,
        help="Seconds a tensor-parallel collective may wait for a peer rank; past it (or at once when a "
             "peer's connection closes) the rank exits and the server fails its requests with an error.")
    add("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=d["dp_size"].default,
        help="Data parallel size: N > 1 starts N replicas of this server (each a full server on its own "
             "loopback port, with the other flags given here; with --tp-size M, N x M ranks) behind "
             "sglang-router (pip install sglang-router), which launch_server starts and which clients reach "
             "through --host:--port; /server_info lists every replica's state. The router's own flags are "
             "accepted with a --router- prefix (--router-policy round_robin, --router-disable-retries, ...), "
             "as by SGLang's sglang_router.launch_server.")
    add("--mem-fraction-static", type=float, default=None,
        help="Fraction of the device's memory (RAM on a CPU) for weights and the KV pool, as in "
             "SGLang: the KV pool gets what is left of it after loading the weights (the exact pool in "
             "full mode, the compressed tier in two-tier modes). --max-total-tokens and "
             "--device-kv-budget take precedence. Default: a quarter of the memory free after loading.")
    add("--trust-remote-code", action="store_true",
        help="Let transformers run code shipped with the model folder's config or tokenizer.")
    add("--quantization", type=str, default=None,
        help="Weight quantization. None is supported here: a value is refused with an error.")
    add("--schedule-policy", type=str, default=d["schedule_policy"].default, choices=SCHEDULE_POLICIES,
        help="Order of waiting requests: fcfs (arrival) or lpm (longest cached prefix first, so requests "
             "that share a prefix run while it is cached; fcfs beyond 128 waiting).")
    add("--enable-metrics", action="store_true",
        help="Changes nothing here: Prometheus metrics are always served at /metrics (SGLang serves them "
             "only with this flag). Accepted so that SGLang command lines run.")
    add("--log-requests", action="store_true",
        help="Log every request when it arrives (sizes, sampling parameters) and when it finishes "
             "(tokens, finish reason, text).")
    add("--decode-log-interval", type=int, default=d["decode_log_interval"].default,
        help="Decode iterations between the scheduler's \"Decode batch.\" log lines (running and waiting "
             "requests, KV use of each tier, generation throughput); each prefill batch logs a "
             "\"Prefill batch.\" line. Shown at --log-level info.")
    add("--watchdog-timeout", type=float, default=None,
        help="Seconds one scheduler iteration (a forward) may run before the server counts it as hung: "
             "the scheduler dumps its threads' stacks and exits, and requests fail with an error "
             "instead of waiting forever. Default: 300 on CUDA; off on a CPU, where one prefill chunk "
             "of a large model can take minutes.")
    add("--sampling-defaults", type=str, default=d["sampling_defaults"].default, choices=("openai", "model"),
        help="What an OpenAI request that leaves temperature / top_p / top_k / min_p / repetition_penalty unset "
             "gets: model: the checkpoint's generation_config.json (for the default model, its model card's "
             "temperature 0.2, top_p 0.9), else OpenAI's; openai: OpenAI's (temperature 1, top_p 1).")
    add("--enable-cache-report", action="store_true",
        help="OpenAI responses report prefix-cache hits as usage.prompt_tokens_details.cached_tokens.")
