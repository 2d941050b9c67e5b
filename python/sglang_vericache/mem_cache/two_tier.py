"""TwoTierKV: the compressed tier beside the exact one, and folding exact pages into it.

Per request (two-tier modes), on top of the exact-tier invariant in Req:
  comp_indices  chunk ids of pages [0, C); C * page_size <= kv_committed_len.
  comp_layer_chunks  None, or where a segment's chunks are dealt to the layers (global head budgets,
                PyramidKV's per-segment budgets; mem_cache/compressed_pool.py) each layer's flat chunks of
                those ids; freeing the ids frees them all.
  q_hist        per layer, post-RoPE queries [n, H_q*D] of positions [C*ps, kv_committed_len)
                (only for query-scored compressors: snapkv, pyramidkv, h2o, kvzip_proxy; kvzap:
                the attention inputs [n, hidden] instead).
kvzip scores with reconstruction passes of the model instead (ReconstructionRunner,
compress/kvzip_reconstruction.py, which the scheduler builds and hands to TwoTierKV.reconstruction):
one per page in page scope, a segment's chunked replay in segment scope.

Two scopes (`segment_scope`, --kv-compress-scope):
  page     a page is folded (compressed) alone as soon as its exact KV is committed, so the exact
           tail that drafting reads, positions [C*ps, kv_committed_len), is shorter than a page.
  segment  (token droppers) nothing is folded while the prompt's prefill is under way; when it
           completes, the prompt's whole pages are folded as segments of up to
           --kv-compress-segment-tokens, each ranked whole with every query kept since its start
           (SnapKV's window: the prompt's last W queries). Generated tokens stay exact until the
           tail reaches 2 * --kv-recent-window; then its older whole pages are folded as one
           segment, leaving kv_recent_window..+ps-1 exact. q_hist then ends at kv_committed_len and
           starts wherever the request's queries do (a prefix hit's exact KV has none).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import torch

from sglang_vericache.compress.base import CompressorConfig
from sglang_vericache.compress.kvzip import ReconstructionPass, reconstruction_scores
from sglang_vericache.compress.registry import get_compressor
from sglang_vericache.distributed.parallel_state import get_tp_group
from sglang_vericache.mem_cache.compressed_pool import CompressedKVPool, compress_pages, compress_segment
from sglang_vericache.server_args import parse_bytes

if TYPE_CHECKING:
    from sglang_vericache.mem_cache.cache_req import CacheReq
    from sglang_vericache.model_executor.model_runner import ModelRunner
    from sglang_vericache.server_args import ServerArgs

logger = logging.getLogger(__name__)

DEFAULT_COMP_CHUNKS = 4096


def head_adaptive_refusal(compressor, name: str, segment_scope: bool, budget: str = "adaptive") -> str | None:
    """Why --kv-head-budget adaptive or global cannot run here (None: it can): it needs segment scope and one
    score-based token dropper (compress/head_budget.py); global also one layout in every layer."""
    from sglang_vericache.compress.token_drop import TokenDropCompressor

    if "+" in name:
        return "a DROP+QUANT composition"
    if not isinstance(compressor, TokenDropCompressor):
        return "not a token dropper"
    if type(compressor).segment_scores is TokenDropCompressor.segment_scores:
        return "its selection is not a per-token score"
    if not segment_scope:
        return "page scope (a page alone keeps a uniform budget): use --kv-compress-scope segment"
    if budget == "global" and getattr(compressor, "own_layer_budgets", False):
        return "its layer budgets are its own"
    return None


class TwoTierKV:
    """The compressed tier of a two-tier instance. Built from the server args and the model runner
    (its pools and model config); tree_cache, the two-tier radix cache built over this tier's pool,
    is set once right after (Scheduler.__init__): folding and admission evict its unlocked chunks."""

    def __init__(self, args: ServerArgs, model_runner: ModelRunner):
        mc = model_runner.model_config
        self.page_size = args.page_size
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.kv_pool = model_runner.token_to_kv_pool
        self.max_draft_tokens = args.max_draft_tokens
        self.tree_cache = None
        self.fold_pages, self.fold_seconds = 0, 0.0  # pages folded so far and the seconds it took
        head_budget = args.kv_head_budget
        cfg = CompressorConfig.from_model_config(
            args.kv_compressor, args.kv_compression_ratio, self.page_size, mc, dtype=self.kv_pool.dtype,
            head_budget="uniform" if head_budget == "auto" else head_budget, keep_recent=args.kv_keep_recent,
        )
        self.compressor = get_compressor(args.kv_compressor, cfg)
        self.segment_scope = self.resolve_scope(args)
        if head_budget == "auto":  # the method's own, where it can run
            head_budget = getattr(self.compressor, "default_head_budget", "uniform")
            if head_adaptive_refusal(self.compressor, args.kv_compressor, self.segment_scope, head_budget):
                head_budget = "uniform"
        elif head_budget != "uniform":
            refusal = head_adaptive_refusal(self.compressor, args.kv_compressor, self.segment_scope, head_budget)
            if refusal is not None:
                raise ValueError(f"--kv-head-budget {head_budget}: not with {args.kv_compressor} ({refusal})")
        # layer budgets per segment in segment scope (DROP+QUANT keeps its static layout)
        final = dataclasses.replace(cfg, head_budget=head_budget,
                                    segment_layers=self.segment_scope and "+" not in args.kv_compressor)
        if final != cfg:  # the compressor the scope and budgets resolved to (built once more at most)
            self.compressor = get_compressor(args.kv_compressor, final)
        n_layers = mc.num_hidden_layers
        device_bytes, flag = None, "--device-kv-budget"
        if args.device_kv_budget is not None:
            device_bytes = parse_bytes(args.device_kv_budget, flag)
        elif model_runner.static_kv_bytes is not None:
            device_bytes, flag = model_runner.static_kv_bytes, "--mem-fraction-static"
        if device_bytes is not None:
            budget = device_bytes - self.device_overhead_bytes(args, model_runner)
            num_chunks = CompressedKVPool.chunks_for_budget(self.compressor, n_layers, max(budget, 0))
        else:
            num_chunks = max(DEFAULT_COMP_CHUNKS, 2 * model_runner.max_total_num_tokens // self.page_size)
        num_chunks = get_tp_group().min_over_ranks(num_chunks)  # the same capacity on every TP rank
        if num_chunks < 1:
            raise ValueError(f"{flag} leaves too little accelerator memory for one compressed chunk")
        self.pool = CompressedKVPool(self.compressor, n_layers, num_chunks, device=model_runner.device)
        self.segment_pages = args.kv_compress_segment_tokens // self.page_size
        self.recent_window = args.kv_recent_window
        self.windows = [self.compressor.query_window(layer) for layer in range(n_layers)]
        self.needs_queries = any(w > 0 for w in self.windows)
        self.reads_hidden = bool(getattr(self.compressor, "reads_hidden", False))  # kvzap: q_hist holds hidden states
        model_runner.capture_hidden = self.reads_hidden
        if self.reads_hidden:
            hidden = self.compressor.surrogate.hidden_size  # a missing surrogate fails here, by name
            if hidden != mc.hidden_size:
                raise ValueError(f"kvzap: the surrogate reads hidden states of {hidden}, the model's are "
                                 f"{mc.hidden_size}")
        # kvzip: the model's reconstruction passes of what it folds, handed in by whoever builds the
        # cache (the scheduler: compress/kvzip_reconstruction.py); the cache never runs the model itself.
        self.reconstruction = None
        budgets = ""
        if self.segment_scope:
            drop = getattr(self.compressor, "drop", self.compressor)
            layers = "per-segment" if getattr(drop, "deals_layers", False) else "fixed"
            budgets = f" ({drop.config.head_budget} head budgets, {layers} layer budgets)"
        logger.info(
            "compressed tier: %s, %s scope%s, %d chunks of %d tokens, %.1f MiB (%.2fx smaller than exact)",
            args.kv_compressor, "segment" if self.segment_scope else "page", budgets, num_chunks, self.page_size,
            self.pool.size_bytes() / 2**20, self.compressor.effective_ratio(),
        )

    @property
    def keep_recent(self) -> int:
        """The tokens a segment's end keeps first (TokenDropCompressor.protected's cap): 0 in page scope,
        for quantizers and for droppers whose rule keeps recent tokens of its own."""
        drop = getattr(self.compressor, "drop", self.compressor)
        return getattr(drop, "keep_recent", 0) if self.segment_scope else 0

    def resolve_scope(self, args: ServerArgs) -> bool:
        """Whether the compressor ranks segments (True) or pages (False), from --kv-compress-scope."""
        comp = self.compressor
        capable = hasattr(comp, "compress_segment")
        others = args.kv_store != "none" or args.disagg_role != "none"  # they share compressed pages
        if args.kv_compress_scope == "segment":
            if not capable or others:
                why = "its rows are not a token selection" if not capable else "a KV store or dual instance"
                raise ValueError(f"--kv-compress-scope segment: not with {args.kv_compressor} ({why}); "
                                 "use page")
            return True
        # n-gram drafting's invariant (the same drafts as plain VeriCache, fewer draft forwards) is tested
        # on page scope only so far: auto keeps it there.
        return args.kv_compress_scope == "auto" and capable and not others and not args.speculative_ngram

    @staticmethod
    def device_overhead_bytes(args: ServerArgs, model_runner: ModelRunner) -> int:
        """Accelerator KV memory besides the compressed tier: the drafts' scratch KV and the
        double-buffered staging area of streamed verification."""
        per_token = model_runner.token_to_kv_pool.bytes_per_token()  # all layers
        total = 0
        # Adaptive VeriCache counts the drafts' scratch per drafting request (mem_cache/placement.py).
        if args.kv_mode == "vericache" and not args.adaptive:
            total += (1 + model_runner.req_to_token_pool.size * (args.max_draft_tokens + 1)) * per_token
        if args.uses_link and not args.adaptive:  # adaptive: the placement books staging when it is used
            total += 2 * args.verify_staging_tokens * per_token // model_runner.model_config.num_hidden_layers
        return total

    # ------------------------------------------------------------------ queries

    def keeps_queries(self, reqs) -> bool:
        """Whether a forward of reqs captures queries: the compressor scores with them and some req
        folds (a decode-only request has no compressed tier; record_queries keeps none of its)."""
        return self.needs_queries and any(not r.spec.decode_only for r in reqs)

    def record_queries(self, req: CacheReq, captured: dict, rows: slice, n_keep: int | None = None) -> None:
        """Appends this pass's queries of req (rows of the flattened batch) to its history."""
        if not self.needs_queries or req.spec.decode_only:
            return
        for layer, q in captured.items():
            new = q[rows] if n_keep is None else q[rows][:n_keep]
            old = req.q_hist.get(layer)
            req.q_hist[layer] = new if old is None else torch.cat([old, new])

    # ------------------------------------------------------------------ folding

    def fold_end(self, req: CacheReq, prefilling: bool = False, committed: int | None = None) -> int:
        """Pages [0, end) that should be folded now, or once committed tokens are (see the module
        docstring's scopes)."""
        ps, c = self.page_size, len(req.comp_indices)
        committed = req.kv_committed_len if committed is None else committed
        if not self.segment_scope:
            return committed // ps
        if prefilling:
            return c  # the prompt is folded whole once its prefill completes
        if c < len(req.origin_input_ids) // ps:
            return committed // ps  # the prompt (or a retracted request's prompt and outputs)
        if committed - c * ps < 2 * self.recent_window:
            return c
        return max(c, (committed - self.recent_window) // ps)

    def fold(self, req: CacheReq, prefilling: bool = False) -> bool:
        """Compresses the whole committed pages past comp_indices that are due (fold_end);
        prefilling: req's prefill is not complete yet. False if the pool is full."""
        ps = self.page_size
        c = len(req.comp_indices)
        p = self.fold_end(req, prefilling)
        if p <= c or req.spec.decode_only:
            return True
        ids = self.alloc_chunks(p - c)
        if ids is None:
            return False
        t0 = time.perf_counter()
        if self.segment_scope:
            self.fold_segments(req, c, p, ids)
            req.comp_indices = torch.cat([req.comp_indices, ids])
            self.fold_pages += p - c
            self.fold_seconds += time.perf_counter() - t0
            return True
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, c * ps : p * ps]
        queries = None
        if self.needs_queries:
            queries = []
            for layer, w in enumerate(self.windows):
                if w == 0:
                    queries.append(None)
                    continue
                hist = req.q_hist[layer][: (p - c) * ps].unflatten(0, (p - c, ps))  # [n, T, H_q*D or hidden]
                q = hist[:, ps - w :]
                if not self.reads_hidden:
                    q = q.unflatten(-1, (-1, self.compressor.config.head_dim))
                queries.append(q)
            for layer in list(req.q_hist):
                req.q_hist[layer] = req.q_hist[layer][(p - c) * ps :]
        positions = torch.arange(c * ps, p * ps, dtype=torch.int64)
        if self.compressor.needs_reconstruction:
            self.fold_reconstructed(req, c, p, slots, ids, positions)
        else:
            compress_pages(self.compressor, self.kv_pool, self.pool, slots, ids,
                           positions=positions, queries=queries)
        req.comp_indices = torch.cat([req.comp_indices, ids])
        self.fold_pages += p - c
        self.fold_seconds += time.perf_counter() - t0
        return True

    def fold_segments(self, req: CacheReq, c: int, p: int, ids: torch.Tensor) -> None:
        """Pages [c, p) of req as segments of up to segment_pages pages, each ranked whole with the
        queries kept since its start; then q_hist keeps those of positions >= p * ps."""
        ps, committed = self.page_size, req.kv_committed_len
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        num_q = 0 if not self.needs_queries else len(next(iter(req.q_hist.values()), ()))
        q_start = committed - num_q  # q_hist's rows: positions [q_start, committed)
        for s in range(c, p, self.segment_pages):
            e = min(p, s + self.segment_pages)
            queries = q_positions = None
            if self.reconstruction is not None:
                queries = self.segment_reconstruction_scores(req, s * ps, e * ps)
            elif self.needs_queries:
                lo = max(0, s * ps - q_start)
                q_positions = torch.arange(q_start + lo, committed, dtype=torch.int64)
                queries = []
                for layer in range(len(self.windows)):
                    hist = req.q_hist.get(layer)
                    if hist is None or not self.compressor.segment_queries(layer):
                        queries.append(None)
                        continue
                    q = hist[lo:]
                    queries.append(q if self.reads_hidden else q.unflatten(-1, (-1, self.compressor.config.head_dim)))
            seg_ids = ids[s - c : e - c]
            chunks = compress_segment(self.compressor, self.kv_pool, self.pool, row[s * ps : e * ps], seg_ids,
                                      torch.arange(s * ps, e * ps, dtype=torch.int64), queries, q_positions)
            # Dealt to the layers (per-segment layer budgets): kept per layer from the first segment whose
            # dealing is not each layer's own ids (until then, and without it, chunk id c of layer l is c). The
            # flat chunks are handed out in (layer, id) order, so a dealing is each layer's own iff every layer
            # got len(seg_ids) of them.
            if chunks is not None and (req.comp_layer_chunks is not None
                                       or any(len(mine) != len(seg_ids) for mine in chunks)):
                if req.comp_layer_chunks is None:  # the chunks before: their own
                    done = torch.cat([req.comp_indices, ids[: s - c]])
                    req.comp_layer_chunks = [self.pool.layer_chunks(layer, done) for layer in range(len(chunks))]
                req.comp_layer_chunks = [torch.cat([a, b]) for a, b in zip(req.comp_layer_chunks, chunks)]
        drop = max(0, p * ps - q_start)
        for layer in list(req.q_hist):
            req.q_hist[layer] = req.q_hist[layer][drop:]

    def segment_reconstruction_scores(self, req: Req, start: int, end: int) -> list[torch.Tensor]:
        """kvzip over a segment: per layer, the scores [H_kv, end - start] of the tokens [start, end)
        from the segment's replay, chunk by chunk (each chunk's keys scored by its own pass)."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        scale, dev = self.compressor.config.scale, self.pool.device
        scores: list[list[torch.Tensor]] = [[] for _ in range(self.kv_pool.num_layers)]
        for a, b, layers in self.reconstruction.segment_passes(req.req_pool_idx, req.fill_ids, start, end):
            slots = row[a:b].to(self.kv_pool.device)
            for layer, rec in enumerate(layers):
                k = self.kv_pool.get_key_buffer(layer)[slots].to(dev)
                scores[layer].append(reconstruction_scores(rec, k, scale))
        return [torch.cat(parts, dim=-1) for parts in scores]

    def fold_seconds_per_page(self) -> float | None:
        """Measured seconds to fold one page (every layer); None before any fold."""
        return self.fold_seconds / self.fold_pages if self.fold_pages else None

    def fold_reconstructed(self, req: CacheReq, c: int, p: int, slots, ids, positions) -> None:
        """Pages [c, p) of req through their reconstruction passes; pages whose passes have the
        same shape (every page after the first) are compressed together."""
        if self.reconstruction is None:
            raise RuntimeError(f"{self.compressor.name} folds pages through a reconstruction pass, and none was "
                               "handed to this TwoTierKV (compress/kvzip_reconstruction.py: reconstruction_for)")
        ps = self.page_size
        passes = self.reconstruction.passes(req.req_pool_idx, req.fill_ids, [i * ps for i in range(c, p)])
        groups: dict[tuple, list[int]] = {}
        for j, layers in enumerate(passes):
            rec = layers[0]
            groups.setdefault((rec.q.shape[0], None if rec.sink_k is None else rec.sink_k.shape[0]), []).append(j)
        for members in groups.values():
            sel = torch.tensor(members)
            rows = (sel[:, None] * ps + torch.arange(ps)).flatten()
            recs = [
                ReconstructionPass(
                    torch.stack([passes[j][layer].q for j in members]),
                    torch.stack([passes[j][layer].k for j in members]),
                    None if passes[members[0]][layer].sink_k is None
                    else torch.stack([passes[j][layer].sink_k for j in members]),
                )
                for layer in range(len(passes[0]))
            ]
            compress_pages(self.compressor, self.kv_pool, self.pool, slots[rows.to(slots.device)], ids[sel],
                           positions=positions[rows], queries=recs)

    def alloc_chunks(self, n: int) -> torch.Tensor | None:
        short = n - self.pool.available_chunks()
        if short > 0:
            self.tree_cache.evict_compressed(short)
        return self.pool.alloc(n)

    # ------------------------------------------------------------------ admission and memory

    def usable_match(self, match):
        """Query-scored compressors (and kvzip, whose pass is a forward of the model) do not rebuild
        chunks from exact KV alone: their usable exact prefix ends where the compressed one does
        (the rest is recomputed). Segment scope: the request compresses its whole prompt itself
        (no compressed chunk is shared); its exact hit is used unless the compressor ranks each
        token by its own query (kvzip_proxy, kvzap: segment_queries == 2), which the hit lacks."""
        if self.segment_scope:
            own = any(self.compressor.segment_queries(layer) == 2 for layer in range(len(self.windows)))
            return type(match)(
                device_indices=match.device_indices[:0] if own else match.device_indices,
                last_node=match.last_node,
                comp_indices=match.comp_indices[:0],
                page_size=match.page_size,
            )
        if not (self.needs_queries or self.reconstruction) or match.comp_len >= len(match.device_indices):
            return match
        return type(match)(
            device_indices=match.device_indices[: match.comp_len],
            last_node=match.last_node,
            comp_indices=match.comp_indices,
            page_size=match.page_size,
        )

    def can_admit(self, req: CacheReq, match, n: int, batch: list, running: list[CacheReq],
                  chunked_req: CacheReq | None) -> bool:
        """Whether the compressed tier can take req's prompt pages, on top of the pages the
        batch and the chunked prefill still need and a page per running request."""
        ps = self.page_size

        def pages_left(r: CacheReq, have: int) -> int:
            return 0 if r.spec.decode_only else max(0, r.prefill_target_len() // ps - have)

        need = pages_left(req, len(match.comp_indices))
        need += sum(pages_left(r, len(r.comp_indices)) for r, _ in batch)
        if chunked_req is not None and all(r is not chunked_req for r, _ in batch):
            need += pages_left(chunked_req, len(chunked_req.comp_indices))
        need += len(running) * (1 + (self.max_draft_tokens + ps - 1) // ps)
        # The matched chunks are about to be locked: they stop being evictable (conservatively
        # assume they are evictable now, so they are not counted twice).
        free = self.pool.available_chunks() + self.tree_cache.comp_evictable_chunks() - len(match.comp_indices)
        return need <= free

    def reserve_fold_chunks(self, running: list[CacheReq], new_tokens) -> bool:
        """Makes room for the chunks the running requests fold if each commits new_tokens(r)."""
        need = sum(max(0, self.fold_end(r, committed=r.kv_committed_len + new_tokens(r)) - len(r.comp_indices))
                   for r in running if not r.spec.decode_only)
        short = need - self.pool.available_chunks()
        if short > 0:
            self.tree_cache.evict_compressed(short)
        return need <= self.pool.available_chunks()

    # ------------------------------------------------------------------ drafting context

    def draft_context(self, reqs: list[CacheReq], draft_pool=None, draft_slots=None, new_kv: str = "draft"):
        from sglang_vericache.model_executor.forward_batch import DraftContext

        ps = self.page_size
        extra = 1 if new_kv == "exact" else 0  # lossy: the tail includes the new token
        return DraftContext(
            compressed_pool=self.pool,
            comp_ids=[r.comp_indices for r in reqs],
            layer_chunks=None if all(r.comp_layer_chunks is None for r in reqs)
            else [r.comp_layer_chunks for r in reqs],
            tail_lens=[r.kv_committed_len + extra - len(r.comp_indices) * ps for r in reqs],
            draft_pool=draft_pool,
            draft_slots=draft_slots,
            new_kv=new_kv,
        )
