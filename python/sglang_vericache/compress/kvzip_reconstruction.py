"""KVzip's context-reconstruction pass (compress/kvzip.py), run by the model for the pages a
request folds. The scheduler builds it (reconstruction_for) and hands it to the two-tier cache,
which calls it for every page it folds: the cache never starts a model forward of its own.

For the page [s, e) of a request, one EXTEND forward of R rows, [repeat prompt | the page's ids],
at positions e .. e+R-1: the rows attend to the request's exact KV [0, e) and causally to each
other, and every layer's post-RoPE q and k of the R rows are captured. Its KV goes to scratch
slots this runner owns (reserved once, read by nothing else), through a req_to_token row it owns
whose [0, e) is a copy of the request's: nothing of the request, the pools or the radix tree
changes. One page per forward, batch of one: a page's pass depends on its prefix alone (the
same bytes batched or alone, in one prefill chunk or several, on a prefix hit or not).

Segment scope (`segment_passes`) replays a whole segment [s, e) as kvpress's KVzipPress replays a
context: in chunks of up to `chunk_tokens` (kvpress's chunk_size, 2,048), each chunk's pass placed
right after the segment (positions e, e+1, ...) and attending to the exact KV [0, e), so every
reconstruction query sees the whole segment.

The repeat prompt is kvpress's (REPEAT_FIRST before page 0, REPEAT_NEXT and the previous
REPEAT_TAIL_TOKENS ids before the others), tokenized by the model's tokenizer; a checkpoint
without one (random test checkpoints) gets fixed ids 1..len in their place.
"""

from __future__ import annotations

import logging
import time

import torch

from sglang_vericache.compress.base import KVZIP_CHUNK_TOKENS
from sglang_vericache.compress.kvzip import REPEAT_FIRST, REPEAT_NEXT, REPEAT_TAIL_TOKENS, ReconstructionPass
from sglang_vericache.model_executor.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

NO_TOKENIZER_FIRST = list(range(1, 11))  # stand-ins for the prompts without a tokenizer
NO_TOKENIZER_NEXT = list(range(1, 16))


def repeat_prompts(tokenizer) -> tuple[list[int], list[int]]:
    """(the first page's prompt ids, the later pages' prompt ids before the previous tail)."""
    if tokenizer is None:
        return list(NO_TOKENIZER_FIRST), list(NO_TOKENIZER_NEXT)
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return enc(REPEAT_FIRST), enc(REPEAT_NEXT)


class ReconstructionRunner:
    """Holds the pass's scratch (a req_to_token row and the KV slots of max_rows tokens) and runs
    it; seconds / tokens / forwards add up what it cost (reported apart from the prefill)."""

    def __init__(self, model_runner, page_size: int, prompts: tuple[list[int], list[int]], num_sink_tokens: int,
                 chunk_tokens: int | None = None):
        self.runner = model_runner
        self.page_size = page_size
        self.chunk_tokens = page_size if chunk_tokens is None else chunk_tokens  # context tokens per pass
        self.first, self.next = list(prompts[0]), list(prompts[1])
        self.num_sink_tokens = num_sink_tokens
        self.max_rows = max(len(self.first), len(self.next) + REPEAT_TAIL_TOKENS) + self.chunk_tokens
        r2t = model_runner.req_to_token_pool
        margin = r2t.max_context_len - model_runner.model_config.context_len
        if self.max_rows > margin:
            what = "a page" if chunk_tokens is None else "a chunk"
            raise ValueError(
                f"kvzip: the reconstruction pass of {what} of {self.chunk_tokens} tokens forwards {self.max_rows} rows "
                f"past the context, more than the {margin} positions the runtime keeps there; use a "
                f"--page-size of at most {margin - self.max_rows + self.chunk_tokens}"
            )
        self.row = r2t.alloc()
        alloc = model_runner.token_to_kv_pool_allocator
        pages = alloc.alloc_pages(-(-self.max_rows // page_size)) if self.row is not None else None
        if pages is None:
            raise ValueError("kvzip: no room for the reconstruction pass's scratch (one request row and "
                             f"{self.max_rows} KV slots); raise --max-total-tokens or --max-running-requests")
        offsets = torch.arange(page_size)
        self.scratch = torch.cat([p * page_size + offsets for p in pages])[: self.max_rows]
        self.seconds = 0.0
        self.tokens = 0
        self.forwards = 0

    def prompt(self, ids: list[int], start: int) -> list[int]:
        if start == 0:
            return self.first
        return self.next + ids[max(0, start - REPEAT_TAIL_TOKENS) : start]

    def passes(self, req_pool_idx: int, ids: list[int], starts: list[int]) -> list[list[ReconstructionPass]]:
        """Per page start s (a page of ids [s, s + page_size) with exact KV in the request's row):
        its pass, one ReconstructionPass per layer, unbatched (q [R, H_q, D], k [R, H_kv, D],
        sink_k [min(S, s), H_kv, D] or None)."""
        return [self.one(req_pool_idx, ids, s, s + self.page_size, s + self.page_size) for s in starts]

    def segment_passes(self, req_pool_idx: int, ids: list[int], start: int, end: int):
        """The segment [start, end) replayed in chunks of up to chunk_tokens: yields (chunk start,
        chunk end, its pass per layer), each pass at positions end, end+1, ... over the exact KV
        [0, end) (sink_k: the keys of [0, min(S, chunk start)))."""
        for a in range(start, end, self.chunk_tokens):
            b = min(end, a + self.chunk_tokens)
            yield a, b, self.one(req_pool_idx, ids, a, b, end)

    def one(self, req_pool_idx: int, ids: list[int], start: int, stop: int, end: int) -> list[ReconstructionPass]:
        """The pass of ids [start, stop) after its repeat prompt, at positions end, end+1, ...,
        attending to the request's exact KV [0, end)."""
        t0 = time.perf_counter()
        mr = self.runner
        rows = self.prompt(ids, start) + list(ids[start:stop])
        r = len(rows)
        r2t = mr.req_to_token_pool.req_to_token
        own = r2t[req_pool_idx, :end]
        r2t[self.row, :end] = own
        slots = self.scratch[:r].to(r2t.device)
        r2t[self.row, end : end + r] = slots
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=1,
            input_ids=t(rows),
            positions=torch.arange(end, end + r, dtype=torch.int64),
            req_pool_indices=t([self.row]),
            seq_lens=t([end + r]),
            extend_prefix_lens=t([end]),
            extend_seq_lens=t([r]),
            out_cache_loc=slots,
            seq_lens_cpu=[end + r],
            extend_prefix_lens_cpu=[end],
            extend_seq_lens_cpu=[r],
            logits_indices=torch.empty(0, dtype=torch.int64),
        )
        fb.captured_q, fb.captured_k = {}, {}
        mr.forward(fb)
        pool = mr.token_to_kv_pool
        sinks = own[: min(self.num_sink_tokens, start)]
        out = []
        for layer in range(pool.num_layers):
            q, k = fb.captured_q[layer], fb.captured_k[layer]
            sink_k = pool.get_key_buffer(layer)[sinks.to(pool.device)].to(k.device) if len(sinks) else None
            out.append(ReconstructionPass(q.unflatten(-1, (-1, pool.head_dim)),
                                          k.unflatten(-1, (-1, pool.head_dim)), sink_k))
        self.seconds += time.perf_counter() - t0
        self.tokens += r
        self.forwards += 1
        return out


def reconstruction_for(server_args, model_runner, page_size: int, num_sink_tokens: int,
                       segment_scope: bool) -> ReconstructionRunner:
    """The pass of a kvzip two-tier cache: the repeat prompts in --tokenizer-path's tokenizer (fixed
    ids with --skip-tokenizer-init); over segments, kvpress's replay chunks of KVZIP_CHUNK_TOKENS."""
    tokenizer = None
    if not server_args.skip_tokenizer_init:
        from sglang_vericache.utils.hf_tokenizer import load_tokenizer

        tokenizer = load_tokenizer(server_args)
    return ReconstructionRunner(model_runner, page_size, repeat_prompts(tokenizer), num_sink_tokens,
                                chunk_tokens=KVZIP_CHUNK_TOKENS if segment_scope else None)
