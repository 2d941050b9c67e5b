"""StreamingLLM: attention sinks plus the most recent tokens of the chunk (or segment)."""

from __future__ import annotations

import torch

from sglang_vericache.compress.token_drop import TokenDropCompressor, top_k_indices


class StreamingLLMCompressor(TokenDropCompressor):
    """Keep the global sinks (tokens with absolute position < num_sink_tokens) that lie in this
    chunk, then fill the budget k with the chunk's most recent tokens. If the chunk holds more
    sinks than k, the first k sinks are kept. Same set for every KV head; needs `positions`.
    """

    name = "streamingllm"
    recent_rule = True

    def select(self, layer_id, k, q, positions):
        if positions is None:
            raise ValueError("streamingllm: compress() needs the chunk's absolute positions")
        num_tokens, num_heads = k.shape[-3:-1]
        index = torch.arange(num_tokens, device=k.device)
        # priority: sinks first (earliest first) in (T, 2T], then the others, latest first, in [0, T)
        sink = positions.to(k.device) < self.config.num_sink_tokens
        priority = torch.where(sink, 2 * num_tokens - index, index).unsqueeze(-2)
        return top_k_indices(priority.expand(*k.shape[:-3], num_heads, num_tokens), self.kept(layer_id, k))
