"""KVzip: keep the KV pairs the model attends to when it reconstructs the context (Kim et al.,
2025; kvpress KVzipPress), one page-aligned chunk at a time.

The score of a context KV pair is the largest attention it receives, over the queries of a
teacher-forced reconstruction pass (the model reads a repeat prompt and then the chunk again) and
over the q-heads of its KV group. As kvpress scores one context chunk per pass, the softmax runs
over [the sink keys | the chunk's keys | the pass's own keys (causal)]; `reconstruction_scores`
is exactly that score, given the pass's queries and keys.

`kvzip` (KVzipCompressor) takes the pass the model runner computed (`needs_reconstruction`; see
compress/kvzip_reconstruction.py): for a chunk ending at position e, the forward of
[repeat prompt | the chunk's ids] at positions e, e+1, ..., attending to the exact KV [0, e) and
causally to itself, every layer's post-RoPE q [R, H_q, D] and k [R, H_kv, D] of those R rows,
with the exact keys of positions [0, num_sink_tokens) as the sinks. Over a whole segment
(--kv-compress-scope segment, the default) the segment is replayed in chunks of up to 2,048 tokens
(kvpress's chunk_size), every chunk's pass placed after the segment and reading all of it, and the
top k per head is taken over the whole segment (`segment_keep`). The repeat prompt is
kvpress's: "Repeat the previous context exactly." before the first chunk, "Repeat the part of the
previous context exactly, starting with" and the previous chunk's last tokens before the others.
A chunk's pass reads only the tokens up to its own end, so its compressed bytes are a function of
its prefix (a shared prefix's chunks are reusable, and batching or chunked prefill change nothing).

`kvzip_proxy` (KVzipProxyCompressor) is the cheap stand-in that needs no extra forward: the
chunk's own prefill queries and keys moved T + kvzip_prompt_tokens positions on, as if re-read
right after the chunk. It departs from the paper: the first reading of the chunk is not a
re-reading after it (the copy heads a reconstruction exercises never look back), the prompt's
rows and the sinks are missing.

Both keep a fixed k_l rows per head and layer (the layout is static), where KVzip ranks all
heads and layers together (non-uniform budgets: a head's rows would need masking in the draft
kernels). Keys at positions < num_sink_tokens are kept
first, as kvpress gives them the top score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_vericache.compress.rope import ChunkRope
from sglang_vericache.compress.token_drop import TokenDropCompressor, top_k_indices

# kvpress's repeat prompts (KVzipPress.prepare); the later chunks' prompt ends with the previous
# chunk's last REPEAT_TAIL_TOKENS tokens.
REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
REPEAT_TAIL_TOKENS = 8


@dataclass
class ReconstructionPass:
    """The context-reconstruction forward's view of one layer for the chunks being compressed."""

    q: torch.Tensor  # [..., R, H_q, D] post-RoPE queries of the pass's R tokens
    k: torch.Tensor  # [..., R, H_kv, D] post-RoPE keys of the same tokens (causal among themselves)
    sink_k: torch.Tensor | None = None  # [..., S, H_kv, D] the context's first S keys (None: S = 0)


def reconstruction_scores(rec: ReconstructionPass, k: torch.Tensor, scale: float) -> torch.Tensor:
    """KVzip's score of each of the chunk's keys k [..., T, H_kv, D]: softmax(scale * q.k) of each
    pass query over [the sinks (all visible) | the chunk's T keys (all visible) | the pass's own
    keys (causal)], float32, its chunk part maxed over the R queries and the q-heads of the KV
    group -> [..., H_kv, T]."""
    num_keys, num_kv = k.shape[-3:-1]
    r, num_q = rec.q.shape[-3:-1]
    group = num_q // num_kv
    parts = [k.float(), rec.k.float()]
    sinks = 0
    if rec.sink_k is not None:
        sinks = rec.sink_k.shape[-3]
        parts.insert(0, rec.sink_k.float())
    qf = rec.q.float().unflatten(-2, (num_kv, group)).movedim(-4, -2)  # [..., Hkv, G, R, D]
    keys = torch.cat(parts, dim=-3).movedim(-3, -1).unsqueeze(-3)  # [..., Hkv, 1, D, S+T+R]
    logits = torch.matmul(qf, keys) * scale  # [..., Hkv, G, R, S+T+R]
    own = torch.arange(r, device=k.device)
    future = torch.cat(
        [torch.zeros(r, sinks + num_keys, dtype=torch.bool, device=k.device), own[None, :] > own[:, None]], dim=1
    )  # [R, S+T+R]: pass keys after the query
    probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)[..., sinks : sinks + num_keys]
    return probs.amax(dim=(-3, -2))


class KVzipCompressor(TokenDropCompressor):
    """Per KV head keep the k_l keys with the highest `reconstruction_scores` of the model
    runner's ReconstructionPass (sinks first; ties: lower index)."""

    name = "kvzip"
    needs_reconstruction = True
    default_head_budget = "global"  # KVzip ranks its scores across heads and layers (kvpress KVzipPress)

    def __init__(self, config):
        super().__init__(config)
        self.rope = ChunkRope(config.head_dim, config.rope_parameters)

    def reconstruction_tokens(self) -> int:
        """About the tokens a chunk's reconstruction pass forwards (prompt + the chunk again)."""
        return self.config.kvzip_prompt_tokens + self.config.chunk_size

    def check_pass(self, rec, k: torch.Tensor) -> ReconstructionPass:
        c = self.config
        lead = tuple(k.shape[:-3])
        ok = (
            isinstance(rec, ReconstructionPass)
            and rec.q.dim() == k.dim()
            and tuple(rec.q.shape[:-3]) == lead
            and rec.q.shape[-2:] == (c.num_q_heads, c.head_dim)
            and tuple(rec.k.shape) == (*lead, rec.q.shape[-3], c.num_kv_heads, c.head_dim)
            and (rec.sink_k is None or (tuple(rec.sink_k.shape[:-3]) == lead
                                        and rec.sink_k.shape[-2:] == (c.num_kv_heads, c.head_dim)))
        )
        if not ok:
            got = type(rec).__name__ if not isinstance(rec, ReconstructionPass) else (
                f"{list(rec.q.shape)} {list(rec.k.shape)}")
            raise ValueError(
                f"{self.name}: needs the model runner's ReconstructionPass q [..., R, {c.num_q_heads}, "
                f"{c.head_dim}] and k [..., R, {c.num_kv_heads}, {c.head_dim}] (sink_k [..., S, "
                f"{c.num_kv_heads}, {c.head_dim}] or None), got {got}"
            )
        return rec

    def pass_for(self, layer_id, k, q) -> ReconstructionPass:
        return self.check_pass(q, k)

    def select(self, layer_id, k, q, positions):
        rec = self.pass_for(layer_id, k, q)
        scores = reconstruction_scores(rec, k, self.config.scale)
        if positions is not None:
            sink = (positions.to(k.device) < self.config.num_sink_tokens).unsqueeze(-2)  # [..., 1, T]
            scores = torch.where(sink, float("inf"), scores)
        return top_k_indices(scores, self.kept(layer_id, k))

    def head_safeguard(self) -> float:
        return 0.0  # KVzip ranks a layer's heads with no safeguard (kvpress KVzipPress: "does not rely on safeguards")

    def segment_queries(self, layer_id: int) -> int:
        return 0  # no prefill queries: TwoTierKV hands it the segment's reconstruction scores instead

    def segment_keep(self, layer_id, k, v, q, q_positions, positions):
        return top_k_indices(self.segment_scores(layer_id, k, v, q, q_positions, positions), self.kept(layer_id, k))

    def segment_scores(self, layer_id, k, v, q, q_positions, positions):
        """Segment scope: q is the segment's reconstruction scores [H_kv, S] (TwoTierKV replays the
        segment in chunks, ReconstructionRunner.segment_passes, and scores each chunk's keys with
        reconstruction_scores, as kvpress scores a context chunk by chunk), the sinks' +inf; segment_keep()
        keeps the top kept(layer_id, k) per head over the whole segment, a head-adaptive budget the top
        H_kv * kept over every head (kvpress KVzipPress(layerwise=True))."""
        want = (self.config.num_kv_heads, k.shape[0])
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != want:
            got = type(q).__name__ if not isinstance(q, torch.Tensor) else list(q.shape)
            raise ValueError(f"{self.name}: a segment needs its reconstruction scores {list(want)}, got {got}")
        sink = (positions.to(q.device) < self.config.num_sink_tokens).unsqueeze(0)
        return torch.where(sink, float("inf"), q.float())


class KVzipProxyCompressor(KVzipCompressor):
    """KVzip's scores from the chunk's own T prefill queries instead of a reconstruction pass (see
    the module docstring); a ReconstructionPass given as q is used as is."""

    name = "kvzip_proxy"
    needs_reconstruction = False

    def query_window(self, layer_id: int) -> int:
        return self.config.chunk_size

    def proxy_pass(self, q: torch.Tensor, k: torch.Tensor) -> ReconstructionPass:
        """The chunk's own post-RoPE queries and keys, moved T + kvzip_prompt_tokens positions on."""
        delta = torch.tensor(self.reconstruction_tokens(), device=k.device)
        return ReconstructionPass(self.rope.rotate(q.float(), delta), self.rope.rotate(k.float(), delta))

    def segment_queries(self, layer_id: int) -> int:
        return 2  # each page's own queries

    def segment_keep(self, layer_id, k, v, q, q_positions, positions):
        """Each page scored by its own proxy pass (its prefill queries, as page by page), the
        top kept(layer_id, k) per head over the whole segment (kvpress scores its context chunk by
        chunk and ranks the whole context)."""
        return top_k_indices(self.segment_scores(layer_id, k, v, q, q_positions, positions), self.kept(layer_id, k))

    def segment_scores(self, layer_id, k, v, q, q_positions, positions):
        t, n = self.config.chunk_size, k.shape[0] // self.config.chunk_size
        if q is None or len(q) < n * t:
            raise ValueError(f"{self.name}: a segment needs its own {n * t} queries")
        pages = k.unflatten(0, (n, t))
        scores = reconstruction_scores(self.proxy_pass(q[: n * t].unflatten(0, (n, t)), pages), pages,
                                       self.config.scale)  # [n, H, T]
        scores = scores.permute(1, 0, 2).flatten(1)  # [H, S]
        sink = (positions < self.config.num_sink_tokens).unsqueeze(0)
        return torch.where(sink, float("inf"), scores)

    def pass_for(self, layer_id, k, q) -> ReconstructionPass:
        if isinstance(q, ReconstructionPass):
            return self.check_pass(q, k)
        return self.proxy_pass(self._check_q(layer_id, q, k), k)
