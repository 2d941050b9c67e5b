"""KVzip, chunk-local: keep the KV pairs the model attends to when it reconstructs the context
(Kim et al., 2025; kvpress KVzipPress).

The paper's score of a context KV pair is the largest attention it receives, over the queries of
a teacher-forced reconstruction pass (the model reads "Repeat the previous context exactly."
and then the context again) and over the q-heads of its KV group. kvpress scores one context
chunk per pass, with the softmax over [sink keys | the chunk's keys | the pass's own keys
(causal)]; `reconstruction_scores` is exactly that score for one chunk, given the pass's
queries and keys.

A compressor cannot run the model, so the pass comes from one of two places:

- a `ReconstructionPass` the scheduler computed (the hook; not wired yet): for each page being
  folded, forward [repeat prompt ids | the page's token ids] at positions after the committed
  context, attending to the exact KV before it and causally to itself; capture every layer's
  post-RoPE q [R, H_q, D] and k [R, H_kv, D] of those R tokens (then drop their KV), and pass
  `ReconstructionPass(q, k)` (batched [n, R, ...] for n pages) as compress_pages' queries[layer].
  That costs a forward of R = prompt + T tokens per page over the context: about
  (1 + prompt / T) times the prefill's tokens (`reconstruction_tokens`), reported apart from it.
- the proxy (what runs today, no extra forward): the chunk's own queries and keys from the pass
  that computed it (prefill or verify), moved to where a reconstruction pass would read them,
  right after the chunk and its repeat prompt: rotated by Delta = T + kvzip_prompt_tokens
  positions. So query i of the proxy pass is the chunk's token i, seeing every chunk key at
  distance Delta + i - j and the proxy pass's own keys causally.

Where the proxy departs from the paper: its queries and keys are the first reading of the chunk,
not a re-reading after it (equal at layer 0 up to position, where a query depends on its token
alone; apart above, where the copy heads a real reconstruction exercises look back at the
chunk), and the repeat prompt's own queries and keys are missing; the softmax lacks the global
sink keys (chunk 0 holds them); Delta places the pass as if the chunk were the last of the
context. Both modes keep a fixed k_l rows per head and layer (the layout is static), where KVzip
ranks all heads and layers together (non-uniform budgets). Keys at positions < num_sink_tokens
are kept first, as kvpress gives them the top score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_vericache.compress.rope import ChunkRope
from sglang_vericache.compress.token_drop import TokenDropCompressor, top_k_indices


@dataclass
class ReconstructionPass:
    """The context-reconstruction forward's view of one layer for the chunks being compressed."""

    q: torch.Tensor  # [..., R, H_q, D] post-RoPE queries of the pass's R tokens
    k: torch.Tensor  # [..., R, H_kv, D] post-RoPE keys of the same tokens (causal among themselves)


def reconstruction_scores(rec: ReconstructionPass, k: torch.Tensor, scale: float) -> torch.Tensor:
    """KVzip's score of each of the chunk's keys k [..., T, H_kv, D]: softmax(scale * q.k) of each
    pass query over [the chunk's T keys (all visible) | the pass's own keys (causal)], float32,
    its chunk part maxed over the R queries and the q-heads of the KV group -> [..., H_kv, T]."""
    num_keys, num_kv = k.shape[-3:-1]
    r, num_q = rec.q.shape[-3:-1]
    group = num_q // num_kv
    qf = rec.q.float().unflatten(-2, (num_kv, group)).movedim(-4, -2)  # [..., Hkv, G, R, D]
    keys = (
        torch.cat([k.float(), rec.k.float()], dim=-3).movedim(-3, -1).unsqueeze(-3)
    )  # [..., Hkv, 1, D, T+R]
    logits = torch.matmul(qf, keys) * scale  # [..., Hkv, G, R, T+R]
    own = torch.arange(r, device=k.device)
    future = torch.cat(
        [torch.zeros(r, num_keys, dtype=torch.bool, device=k.device), own[None, :] > own[:, None]], dim=1
    )  # [R, T+R]: pass keys after the query
    probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)[..., :num_keys]
    return probs.amax(dim=(-3, -2))


class KVzipCompressor(TokenDropCompressor):
    """Per KV head keep the k_l keys with the highest `reconstruction_scores` (sinks first; ties:
    lower index), the pass given as a ReconstructionPass or built by the proxy from the chunk's
    own T queries (see the module docstring)."""

    name = "kvzip"

    def __init__(self, config):
        super().__init__(config)
        self.rope = ChunkRope(config.head_dim, config.rope_parameters)

    def query_window(self, layer_id: int) -> int:
        return self.config.chunk_size

    def reconstruction_tokens(self) -> int:
        """Tokens the paper's reconstruction pass forwards per chunk (prompt + the chunk again)."""
        return self.config.kvzip_prompt_tokens + self.config.chunk_size

    def proxy_pass(self, q: torch.Tensor, k: torch.Tensor) -> ReconstructionPass:
        """The chunk's own post-RoPE queries and keys, moved T + kvzip_prompt_tokens positions on."""
        delta = torch.tensor(self.reconstruction_tokens(), device=k.device)
        return ReconstructionPass(self.rope.rotate(q.float(), delta), self.rope.rotate(k.float(), delta))

    def select(self, layer_id, k, q, positions):
        if isinstance(q, ReconstructionPass):
            c = self.config
            lead = tuple(k.shape[:-3])
            ok = (
                q.q.dim() == k.dim()
                and tuple(q.q.shape[:-3]) == lead
                and q.q.shape[-2:] == (c.num_q_heads, c.head_dim)
                and tuple(q.k.shape) == (*lead, q.q.shape[-3], c.num_kv_heads, c.head_dim)
            )
            if not ok:
                raise ValueError(
                    f"{self.name}: a ReconstructionPass must be q [..., R, {c.num_q_heads}, {c.head_dim}] "
                    f"and k [..., R, {c.num_kv_heads}, {c.head_dim}], got {list(q.q.shape)} {list(q.k.shape)}"
                )
            rec = q
        else:
            rec = self.proxy_pass(self._check_q(layer_id, q, k), k)
        scores = reconstruction_scores(rec, k, self.config.scale)
        if positions is not None:
            sink = (positions.to(k.device) < self.config.num_sink_tokens).unsqueeze(-2)  # [..., 1, T]
            scores = torch.where(sink, float("inf"), scores)
        return top_k_indices(scores, self.rows(layer_id))
