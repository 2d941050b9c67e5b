"""Shared machinery of token-dropping compressors: layout, gather, score helpers, and selection
over a whole segment.

A token-drop chunk of layer l stores, per KV head, its own kept set of k_l tokens:
  k, v: [k_l, H_kv, D] in the exact dtype; row j of head h = head h's j-th kept token
  idx:  [k_l, H_kv] int16, the index of that token in what was compressed (the chunk, or the
        segment for compress_segment()), ascending per head

Two scopes. compress() ranks one page's T tokens alone and keeps k_l of them. compress_segment()
ranks a segment of n whole pages (a prompt after its prefill, a run of generated tokens) at once,
with the queries that follow it in view (SnapKV's observation window is the prompt's last W
queries), keeps n * k_l per head, the budget global over the segment, and deals the kept tokens out,
in position order, k_l to each of the n chunks. Attention over the compressed tier is a softmax over
rows whose RoPE is applied, so which chunk holds a row does not matter, and the pool, the layouts and
the draft kernels stay as they are. The score rules live in each method's `select()` / `keep()`
(their budget `kept(layer_id, k)` is k_l per page of k); `segment_keep()` is where a method that
reads queries takes the segment's.

A segment's last tokens. Methods whose rule ranks by a score alone (ExpectedAttention, K-norm, KVzip,
KVzap) keep a segment's last config.keep_recent tokens first (default: the method's own, 128 for KVzap,
which its paper runs beside DMS's sliding window of 128 recent tokens (kvpress DMSPress), 64 for the
others; at most half of what the sinks leave of the budget), inside the budget, then rank the rest: at the
end of a prompt those are its question, which the papers' pipelines never compress (kvpress compresses a
context and appends the question exact). Methods with a recent part of their own
(`recent_rule`: SnapKV's observation window, H2O's recent tokens, StreamingLLM) keep theirs instead.

Head-adaptive budgets (config.head_budget == "adaptive", compress/head_budget.py): compress_segment()
keeps the layer's H_kv * kept tokens by one top-k over `segment_scores()` across heads (AdaKV), and
each stored cell names its KV head (an extra `head` [k_l, H_kv] int8 tensor). Global budgets
(config.head_budget == "global") rank every layer's `ranked_scores()` at once, so the segment is compressed
by mem_cache/compressed_pool.compress_segment, which sees every layer, through `cells_chunk()`.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from sglang_vericache.compress.base import CompressedChunk, KVCompressor, Layout, TensorSpec
from sglang_vericache.compress.head_budget import adaptive_keep, deal_cells, global_keep, own_heads


class TokenDropCompressor(KVCompressor):
    recent_rule = False  # the method's own rule keeps a segment's most recent tokens (no keep_recent)
    default_keep_recent = 64  # keep_recent when config.keep_recent is None (the module docstring)
    default_head_budget = "uniform"  # --kv-head-budget auto in segment scope (mem_cache/two_tier.py)

    def __init__(self, config):
        super().__init__(config)
        if config.chunk_size > torch.iinfo(torch.int16).max:
            raise ValueError(f"chunk_size {config.chunk_size} does not fit int16 indices")
        self.head_adaptive = config.head_budget in ("adaptive", "global")  # cells tagged with their KV head
        self.layer_global = config.head_budget == "global"  # one top-k over every layer (deal_layers)
        if self.head_adaptive and config.num_kv_heads > torch.iinfo(torch.int8).max:
            raise ValueError(f"head-adaptive budgets: {config.num_kv_heads} KV heads do not fit int8 head ids")

    def rows(self, layer_id: int) -> int:
        """k_l: kept rows per head for this layer."""
        return min(self.config.budget, self.config.chunk_size)

    def kept(self, layer_id: int, k: torch.Tensor) -> int:
        """Rows per head to keep of k [..., n * T, H_kv, D]: k_l for each of its n pages."""
        return self.rows(layer_id) * (k.shape[-3] // self.config.chunk_size)

    def segment_queries(self, layer_id: int) -> int:
        """What compress_segment() reads: 0 no queries; 1 the queries given from the segment's start
        on, whichever there are (a prefix hit's exact KV has none); 2 each token's own query (or
        kvzap's hidden state), all of the segment's."""
        return 1 if self.query_window(layer_id) > 0 else 0

    def layout(self, layer_id: int) -> Layout:
        c, n = self.config, self.rows(layer_id)
        return Layout(
            kind="token_drop",
            chunk_size=c.chunk_size,
            rows=n,
            tensors=(
                TensorSpec("k", (n, c.num_kv_heads, c.head_dim), c.dtype),
                TensorSpec("v", (n, c.num_kv_heads, c.head_dim), c.dtype),
                TensorSpec("idx", (n, c.num_kv_heads), torch.int16),
                *((TensorSpec("head", (n, c.num_kv_heads), torch.int8),) if self.head_adaptive else ()),
            ),
        )

    @abstractmethod
    def select(
        self, layer_id: int, k: torch.Tensor, q: torch.Tensor | None, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """[..., H_kv, k_l] int64 chunk-relative indices to keep, ascending per head."""

    def keep(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, q, positions) -> torch.Tensor:
        """What compress() keeps: select()'s indices; methods that also score values override this."""
        return self.select(layer_id, k, q, positions)

    def sliding(self, layer_id: int) -> bool:
        """A sliding-window layer: it keeps its most recent tokens whatever the method (its window never
        reads an older one again; with a budget of the window or more its draft attention is exact)."""
        return layer_id in self.config.sliding_layers

    def keep_chunk(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, q, positions) -> torch.Tensor:
        """compress()'s [..., H_kv, k_l] indices: a sliding layer's most recent, else keep()'s."""
        if self.sliding(layer_id):
            return recent_indices(k, self.rows(layer_id))
        return self.keep(layer_id, k, v, q, positions)

    @property
    def keep_recent(self) -> int:
        """The most of a segment's last tokens kept first: config.keep_recent (None: the method's
        default_keep_recent), 0 for a method's own recent rule."""
        if self.recent_rule:
            return 0
        return self.default_keep_recent if self.config.keep_recent is None else self.config.keep_recent

    def protected(self, layer_id: int, kept: int) -> int:
        """A segment's last tokens kept whatever their score, of a budget of kept (the module docstring): at
        most half of what the sinks leave, so sinks and recent tokens never fill the budget between them."""
        if self.sliding(layer_id):
            return 0
        return min(self.keep_recent, max(0, kept - self.config.num_sink_tokens) // 2)

    def keep_segment(self, layer_id: int, k, v, q, q_positions, positions) -> torch.Tensor:
        """compress_segment()'s uniform [H_kv, n * k_l] indices: a sliding layer's most recent, else
        segment_keep()'s, a segment's protected() last tokens first."""
        kept = self.kept(layer_id, k)
        if self.sliding(layer_id):
            return recent_indices(k, kept)
        recent = self.protected(layer_id, kept)
        if recent == 0:
            return self.segment_keep(layer_id, k, v, q, q_positions, positions)
        scores = self.segment_scores(layer_id, k, v, q, q_positions, positions)
        return top_k_indices(keep_last(scores, recent), kept)

    def compress(self, layer_id, k, v, q=None, positions=None) -> CompressedChunk:
        self._check_kv(k, v)
        rows = self.keep_chunk(layer_id, k, v, q, positions).transpose(-1, -2)  # [..., n, H]
        gather = rows[..., None].expand(*rows.shape, k.shape[-1])
        dtype = self.config.dtype
        tensors = {
            "k": torch.gather(k, -3, gather).to(dtype),
            "v": torch.gather(v, -3, gather).to(dtype),
            "idx": rows.to(torch.int16).contiguous(),
        }
        if self.head_adaptive:  # a page alone: every head keeps its own uniform selection
            tensors["head"] = own_heads(rows.shape[:-1], k.shape[-2], k.device)
        return CompressedChunk(tensors)

    def decompress(self, layer_id, chunk):
        return chunk["k"].float(), chunk["v"].float()

    # ------------------------------------------------------------------ segments

    def segment_keep(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None,
        q_positions: torch.Tensor | None, positions: torch.Tensor,
    ) -> torch.Tensor:
        """[H_kv, kept(layer_id, k)] segment indices to keep, ascending per head. k, v [S, H_kv, D]
        (S = n * T), positions [S]; q [Q, H_q, D] the queries of the Q positions q_positions [Q]
        from the segment's start on (the segment's own, then those after it). Query-free methods:
        their select() over the segment."""
        return self.keep(layer_id, k, v, None, positions)

    def segment_scores(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None,
        q_positions: torch.Tensor | None, positions: torch.Tensor,
    ) -> torch.Tensor:
        """[H_kv, S] the scores segment_keep() ranks (+inf: always kept), comparable across heads: what
        head-adaptive budgets take one top-k over. Methods whose rule is not a score say so."""
        raise ValueError(f"{self.name}: its selection is not a per-token score, so it has no head-adaptive "
                         "budget (--kv-head-budget uniform)")

    def compress_segment(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None,
        q_positions: torch.Tensor | None = None, positions: torch.Tensor | None = None,
    ) -> CompressedChunk:
        """The segment's n chunks (batched, leading dim n): segment_keep()'s rows, k_l per chunk."""
        rows = check_segment(self, k, v, positions)
        if self.head_adaptive and not self.sliding(layer_id):
            return self.compress_segment_adaptive(layer_id, k, v, q, q_positions, positions.to(k.device), rows)
        keep = self.keep_segment(layer_id, k, v, q, q_positions, positions.to(k.device))  # [H, n * k_l]
        return self.rows_chunk(k, v, keep, rows, self.rows(layer_id))

    def rows_chunk(self, k, v, keep: torch.Tensor, n: int, rows: int) -> CompressedChunk:
        """Each head's kept tokens keep [H, n * rows] (ascending) as n chunks of rows per head (deal)."""
        idx = deal(keep, n, rows)  # [n, rows, H]
        gather = idx.flatten(0, 1)[..., None].expand(-1, -1, k.shape[-1])
        dtype = self.config.dtype
        tensors = {
            "k": torch.gather(k, 0, gather).to(dtype).unflatten(0, idx.shape[:2]),
            "v": torch.gather(v, 0, gather).to(dtype).unflatten(0, idx.shape[:2]),
            "idx": idx.to(torch.int16).contiguous(),
        }
        if self.head_adaptive:  # a sliding layer under adaptive budgets: every head its own recent tokens
            tensors["head"] = own_heads(idx.shape[:-1], k.shape[-2], k.device)
        return CompressedChunk(tensors)

    @property
    def deals_layers(self) -> bool:
        """Whether a segment's chunks are dealt to the layers by per-segment layer budgets (deal_layers; the
        pool's compress_segment ranks every layer first): global head budgets here, PyramidKV's own."""
        return self.layer_global

    def deal_layers(self, ranked: dict, n: int) -> dict[int, tuple[int, CompressedChunk | None]]:
        """ranked: layer -> (k, v, ranked_scores) of one segment of n pages, the layers that share its chunks
        -> layer -> (its chunk count c_l, its c_l chunks; None if 0), sum c_l = len(ranked) * n. Global head
        budgets: head_budget.global_keep."""
        layers = sorted(ranked)
        rows = self.rows(layers[0])
        masks, counts = global_keep([ranked[layer][2] for layer in layers], n, rows)
        return {layer: (c, self.cells_chunk(*ranked[layer][:2], mask, c, rows) if c else None)
                for layer, mask, c in zip(layers, masks, counts)}

    def head_safeguard(self) -> float:
        """Head-adaptive budgets: the share of its uniform budget each head keeps first (AdaKV's alpha)."""
        return self.config.alpha_safeguard

    def compress_segment_adaptive(self, layer_id, k, v, q, q_positions, positions, n: int) -> CompressedChunk:
        """compress_segment() with a head-adaptive budget: the layer's H_kv * kept cells by one top-k
        over segment_scores() (head_budget.adaptive_keep), laid out in (token, head) order."""
        kept = self.kept(layer_id, k)
        mask = adaptive_keep(self.ranked_scores(layer_id, k, v, q, q_positions, positions), kept, self.head_safeguard())
        return self.cells_chunk(k, v, mask, n, self.rows(layer_id))

    def ranked_scores(self, layer_id, k, v, q, q_positions, positions) -> torch.Tensor:
        """[H, S] segment_scores() with the segment's protected() last tokens at +inf: what adaptive and
        global budgets rank."""
        scores = self.segment_scores(layer_id, k, v, q, q_positions, positions)
        return keep_last(scores, self.protected(layer_id, self.kept(layer_id, k)))

    def cells_chunk(self, k, v, mask: torch.Tensor, n: int, rows: int) -> CompressedChunk:
        """The kept cells of mask [H, S] (n * rows * H of them) as n head-tagged chunks of rows * H cells, in
        (token, head) order (head_budget.deal_cells)."""
        token, head = deal_cells(mask, n, rows)  # [n, rows, H] each
        cell = (token * k.shape[1] + head).flatten()
        dtype = self.config.dtype
        return CompressedChunk(
            {
                "k": k.flatten(0, 1).index_select(0, cell).to(dtype).view(*token.shape, k.shape[-1]),
                "v": v.flatten(0, 1).index_select(0, cell).to(dtype).view(*token.shape, v.shape[-1]),
                "idx": token.to(torch.int16).contiguous(),
                "head": head.to(torch.int8).contiguous(),
            }
        )


def check_segment(comp: KVCompressor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None) -> int:
    """Checks a segment's k, v [n * T, H_kv, D] and positions [n * T]; returns n."""
    c = comp.config
    num_tokens = k.shape[0]
    if (k.dim() != 3 or k.shape != v.shape or tuple(k.shape[1:]) != (c.num_kv_heads, c.head_dim)
            or num_tokens == 0 or num_tokens % c.chunk_size):
        raise ValueError(f"{comp.name}: a segment's k, v must be [n * {c.chunk_size}, {c.num_kv_heads}, "
                         f"{c.head_dim}], got {list(k.shape)} {list(v.shape)}")
    if num_tokens > torch.iinfo(torch.int16).max:
        raise ValueError(f"{comp.name}: a segment of {num_tokens} tokens does not fit int16 indices")
    if positions is None or tuple(positions.shape) != (num_tokens,):
        raise ValueError(f"{comp.name}: compress_segment() needs the segment's positions [{num_tokens}]")
    return num_tokens // c.chunk_size


def deal(keep: torch.Tensor, n: int, per_chunk: int) -> torch.Tensor:
    """keep [H, n * per_chunk] ascending -> [n, per_chunk, H]: chunk i gets each head's kept
    tokens i * per_chunk .. (i + 1) * per_chunk - 1, in position order."""
    assert keep.shape[-1] == n * per_chunk, f"{keep.shape=} is not {n} chunks of {per_chunk}"
    return keep.unflatten(-1, (n, per_chunk)).permute(1, 2, 0)


def recent_indices(k: torch.Tensor, n: int) -> torch.Tensor:
    """[..., H_kv, n]: the chunk's last n token indices, for every head of k [..., T, H_kv, D]."""
    num_tokens = k.shape[-3]
    recent = torch.arange(num_tokens - n, num_tokens, device=k.device)
    return recent.expand(*k.shape[:-3], k.shape[-2], n)


def keep_last(scores: torch.Tensor, n: int) -> torch.Tensor:
    """[..., S] scores with the last n at +inf (kept first, like the sinks)."""
    if n == 0:
        return scores
    return torch.cat([scores[..., :-n], scores.new_full((*scores.shape[:-1], n), float("inf"))], dim=-1)


def top_k_indices(scores: torch.Tensor, n: int) -> torch.Tensor:
    """[..., N] scores -> [..., n] indices of the n highest, ties to the lower index, ascending."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :n].sort(dim=-1).values


QUERY_BLOCK = 256  # queries scored at once over a segment


def attention_mass_at(
    q: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention the keys k [S, H_kv, D] at positions [S] receive from the queries q [W, H_q, D] at
    q_positions [W], summed over them and the q-heads of each KV group -> [H_kv, S]. Each query
    sees the keys at or before its position (the segment's keys only: softmax over them, as
    kvpress scores a context with its window's queries); float32."""
    num_heads_kv = k.shape[-2]
    group = q.shape[-2] // num_heads_kv
    kf = k.float().permute(1, 2, 0).unsqueeze(1)  # [Hkv, 1, D, S]
    positions, q_positions = positions.to(k.device), q_positions.to(k.device)
    total = torch.zeros(num_heads_kv, k.shape[0], dtype=torch.float32, device=k.device)
    for lo in range(0, q.shape[0], QUERY_BLOCK):  # bounded memory: [Hkv, G, QUERY_BLOCK, S] at a time
        qf = q[lo : lo + QUERY_BLOCK].float().unflatten(-2, (num_heads_kv, group)).permute(1, 2, 0, 3)  # [Hkv, G, w, D]
        logits = torch.matmul(qf, kf) * scale  # [Hkv, G, w, S]
        mask = positions[None, :] > q_positions[lo : lo + QUERY_BLOCK, None]  # [w, S] future keys
        total += torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1).sum(dim=(1, 2))
    return total


def attention_mass(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention each key receives from the chunk's trailing queries, summed over them.

    q: [..., W, H_q, D] are the queries of the chunk's last W tokens, k: [..., T, H_kv, D]. Causal
    within the chunk: query i sits at chunk index T - W + i and sees keys 0..T - W + i. Softmax in
    float32 per (query, q-head); summed over queries and over the q-heads of each KV group
    (q-head h belongs to KV head h // (H_q / H_kv), as in HF repeat_kv). Returns [..., H_kv, T].
    """
    num_q, num_heads_q = q.shape[-3:-1]
    num_keys, num_heads_kv = k.shape[-3:-1]
    group = num_heads_q // num_heads_kv
    qf = q.float().unflatten(-2, (num_heads_kv, group)).movedim(-4, -2)  # [..., Hkv, G, W, D]
    kf = k.float().movedim(-3, -1).unsqueeze(-3)  # [..., Hkv, 1, D, T]
    logits = torch.matmul(qf, kf) * scale  # [..., Hkv, G, W, T]
    qpos = torch.arange(num_keys - num_q, num_keys, device=k.device)
    mask = torch.arange(num_keys, device=k.device)[None, :] > qpos[:, None]  # [W, T] future keys
    probs = torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1)
    return probs.sum(dim=(-3, -2))
