"""Expected Attention, chunk-local: keep the keys that future queries are expected to attend to
(Devoto et al., 2025; kvpress ExpectedAttentionPress)."""

from __future__ import annotations

import torch

from sglang_vericache.compress.rope import ChunkRope, apply_cos_sin
from sglang_vericache.compress.token_drop import TokenDropCompressor, top_k_indices


class ExpectedAttentionCompressor(TokenDropCompressor):
    """Future queries are modelled as Gaussian, q ~ N(mu, Sigma), from the statistics of the
    chunk's own (most recent) queries: RoPE is undone at their positions, those of the first
    `num_sink_tokens` positions are left out, and mu, Sigma (population covariance) are taken per
    q-head. RoPE at a future position p is a rotation R(p); mu and Sigma are moved by its average
    over the next `n_future_positions` positions, R = mean_p R(p): mu' = R mu, Sigma' = R Sigma R^T.
    With s = the attention scale, E[exp(s q.k)] = exp(s mu'.k + s^2 k^T Sigma' k / 2) for each
    stored (post-RoPE) key k, so

        score(k) = mean over the KV group's q-heads of softmax_keys(s mu'.k + s^2 k^T Sigma' k / 2)
                   * ||v||,

    softmax over the chunk's keys other than the sinks (kvpress's rule: its softmax runs over
    keys[n_sink:]). Keys at positions < num_sink_tokens score +inf (kept first,
    as kvpress pads them with the maximum). Per KV head keep the top k_l; ties: lower index.

    Departure from kvpress: statistics come from the chunk's captured queries rather than from
    its hidden states pushed through W_q (the same for Llama-like models, and valid with QK-norm,
    which kvpress refuses). Page by page (compress) the statistics, the softmax and the future
    positions are the chunk's; over a segment (compress_segment, kvpress's rule) the statistics are
    those of every query given (the segment's and those after it, e.g. the whole prompt's), the
    future positions follow the last of them, and the softmax runs over the segment's keys.
    """

    name = "expected_attention"

    def __init__(self, config):
        super().__init__(config)
        self.rope = ChunkRope(config.head_dim, config.rope_parameters)

    def query_window(self, layer_id: int) -> int:
        return self.config.chunk_size

    def keep(self, layer_id, k, v, q, positions):
        q = self._check_q(layer_id, q, k)
        if positions is None:
            raise ValueError(f"{self.name}: compress() needs the chunk's absolute positions")
        return top_k_indices(self.scores(q, k, v, positions.to(k.device)), self.kept(layer_id, k))

    def select(self, layer_id, k, q, positions):
        raise TypeError(
            f"{self.name} scores keys with their values' norms: call keep(layer_id, k, v, q, positions)"
        )

    def segment_keep(self, layer_id, k, v, q, q_positions, positions):
        return top_k_indices(self.segment_scores(layer_id, k, v, q, q_positions, positions), self.kept(layer_id, k))

    def segment_scores(self, layer_id, k, v, q, q_positions, positions):
        if q is None or q_positions is None or len(q) == 0:
            raise ValueError(f"{self.name}: a segment needs its queries")
        return self.scores(q, k, v, positions, q_positions.to(k.device))

    def query_statistics(self, q: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [..., T, H_q, D] post-RoPE at positions [..., T] -> future mu' [..., H_q, D] and
        Sigma' [..., H_q, D, D] (float32)."""
        c = self.config
        q_pre = self.rope.unrotate(q.float(), positions[..., None])
        weight = (positions >= c.num_sink_tokens).float()  # [..., T]: sink queries left out
        weight = torch.where(weight.sum(-1, keepdim=True) > 0, weight, torch.ones_like(weight))
        weight = weight / weight.sum(-1, keepdim=True)  # [..., T]
        mu = (q_pre * weight[..., None, None]).sum(dim=-3)  # [..., H_q, D]
        dev = (q_pre - mu.unsqueeze(-3)).movedim(-3, -1)  # [..., H_q, D, T]
        sigma = torch.matmul(dev * weight[..., None, None, :], dev.transpose(-1, -2))  # [..., H_q, D, D]
        cos, sin = self.rope.mean_cos_sin(positions[..., -1] + 1, c.n_future_positions)  # [..., D]
        cos, sin = cos[..., None, :], sin[..., None, :]  # against [..., H_q, D]
        mu = apply_cos_sin(mu, cos, sin)
        cs, ss = cos[..., None, :], sin[..., None, :]  # against [..., H_q, D, D] along either dim
        sigma = apply_cos_sin(apply_cos_sin(sigma, cs, ss, dim=-2), cs, ss, dim=-1)  # R Sigma R^T
        return mu, sigma

    def scores(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
        q_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[..., H_kv, T] expected-attention scores of the keys at positions (see the class); the
        queries sit at q_positions (default: the keys' own)."""
        c = self.config
        s = c.scale
        mu, sigma = self.query_statistics(q, positions if q_positions is None else q_positions)
        num_kv = k.shape[-2]
        group = mu.shape[-2] // num_kv
        kf = k.float().movedim(-3, -2).unsqueeze(-3)  # [..., H_kv, 1, T, D]
        mu = mu.unflatten(-2, (num_kv, group))  # [..., H_kv, G, D]
        sigma = sigma.unflatten(-3, (num_kv, group))  # [..., H_kv, G, D, D]
        mean_term = (kf * mu.unsqueeze(-2)).sum(-1)  # [..., H_kv, G, T]
        cov_term = (torch.matmul(kf, sigma) * kf).sum(-1)  # k^T Sigma k
        sink = (positions < c.num_sink_tokens).unsqueeze(-2)  # [..., 1, T]
        logits = s * mean_term + 0.5 * s * s * cov_term
        # the sinks are left out of the softmax, as kvpress scores keys[n_sink:] (a chunk of sinks only: its
        # NaN probabilities are all replaced by +inf below)
        logits = logits.masked_fill(sink.unsqueeze(-2), float("-inf"))
        probs = torch.softmax(logits, dim=-1).mean(dim=-2)  # [..., H_kv, T]
        scores = probs * v.float().norm(dim=-1).transpose(-1, -2)
        return torch.where(sink, float("inf"), scores)
