"""KVzap (Jegou et al., 2026; kvpress KVzapPress): KVzip's scores predicted from each layer's
hidden states by a small per-layer surrogate, so serving runs no reconstruction pass.

The surrogate of layer l maps the hidden state h [hidden] that enters the layer's attention
(after its input norm) to one predicted log KVzip score per KV head: linear (W [hidden, H_kv], b)
or a 2-layer MLP (W1 [hidden, M], b1, GELU, W2 [M, H_kv], b2). recipes/kvzap/train.py fits it to
our kvzip's scores at the scope served (compress/kvzip.py: by default a whole segment's replay, else
each page's pass) on the bundled model's training text and writes `kvzap/surrogate.safetensors` in the
checkpoint's folder; `--kv-compressor kvzap`
loads it from --model-path. kvpress regresses KVzip+ (the attention over ||h|| times ||W_o v||) and
thresholds it; here the target is the score kvzip ranks by, and the kept count per head is the
static k_l of every token dropper (sinks first, ties to the lower index).

The chunk's hidden states reach compress() as its q (query_window = T, `reads_hidden`: the
attention layers capture their input instead of their queries, [..., T, hidden]).
"""

from __future__ import annotations

import os

import torch

from sglang_vericache.compress.base import SURROGATE_FILE, surrogate_owner
from sglang_vericache.compress.token_drop import TokenDropCompressor, top_k_indices

# Under a folder of its own: the model loader reads every *.safetensors at the checkpoint's top level.
TRAIN_HINT = "train one with `python recipes/kvzap/train.py --model-path {path}` (minutes on a CPU)"


class KVzapSurrogate:
    """Per-layer score predictors, float32. tensors: w1 [L, hidden, M], b1 [L, M], w2 [L, M, H],
    b2 [L, H] (MLP) or w [L, hidden, H], b [L, H] (linear)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.t = {n: v.float() for n, v in tensors.items()}
        if {"w", "b"} <= self.t.keys():
            self.kind = "linear"
            self.num_layers, self.hidden_size, self.num_kv_heads = self.t["w"].shape
        elif {"w1", "b1", "w2", "b2"} <= self.t.keys():
            self.kind = "mlp"
            self.num_layers, self.hidden_size, _ = self.t["w1"].shape
            self.num_kv_heads = self.t["w2"].shape[-1]
        else:
            raise ValueError(f"a KVzap surrogate holds w, b (linear) or w1, b1, w2, b2 (MLP), got {sorted(self.t)}")

    @staticmethod
    def load(path: str) -> KVzapSurrogate:
        from safetensors.torch import load_file

        return KVzapSurrogate(load_file(path))

    def save(self, path: str, metadata: dict[str, str] | None = None) -> None:
        from safetensors.torch import save_file

        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        save_file({n: v.contiguous() for n, v in self.t.items()}, path, metadata=metadata)

    def predict(self, layer_id: int, h: torch.Tensor) -> torch.Tensor:
        """h [..., T, hidden] -> predicted log scores [..., T, H_kv] (float32)."""
        t, x = self.t, h.float()
        if self.kind == "linear":
            return x @ t["w"][layer_id].to(x.device) + t["b"][layer_id].to(x.device)
        mid = torch.nn.functional.gelu(x @ t["w1"][layer_id].to(x.device) + t["b1"][layer_id].to(x.device))
        return mid @ t["w2"][layer_id].to(x.device) + t["b2"][layer_id].to(x.device)


class KVzapCompressor(TokenDropCompressor):
    """Per KV head keep the k_l keys whose hidden states the surrogate scores highest."""

    name = "kvzap"
    reads_hidden = True
    default_keep_recent = 128  # KVzap runs beside DMS's sliding window of 128 tokens (kvpress DMSPress)
    default_head_budget = "global"  # its paper keeps what scores above one threshold: per head and layer, no fixed share

    def __init__(self, config, surrogate: KVzapSurrogate | None = None):
        super().__init__(config)
        self._surrogate = None
        if surrogate is not None:
            self._adopt(surrogate, "the given surrogate")

    @property
    def surrogate(self) -> KVzapSurrogate:
        """Loaded on first use (the layout needs none): a clear error if the checkpoint has none.
        The two-tier KV reads it at startup."""
        if self._surrogate is None:
            path = self.config.kvzap_path
            if path is None or not os.path.exists(path):
                where = surrogate_owner(path) if path else "the checkpoint"
                raise ValueError(f"kvzap: {where} has no KVzap surrogate ({path}); " + TRAIN_HINT.format(path=where))
            self._adopt(KVzapSurrogate.load(path), f"the surrogate in {path}")
        return self._surrogate

    def _adopt(self, surrogate: KVzapSurrogate, what: str) -> None:
        if surrogate.num_layers != self.config.num_layers:
            raise ValueError(f"kvzap: {what} has {surrogate.num_layers} layers, the model {self.config.num_layers}")
        self.heads = self._rank_heads(surrogate, self.config)
        self._surrogate = surrogate

    @staticmethod
    def _rank_heads(surrogate: KVzapSurrogate, config) -> slice:
        """The surrogate's output columns of this rank's KV heads (all of them at --tp-size 1)."""
        total, mine = surrogate.num_kv_heads, config.num_kv_heads
        if total == mine:
            return slice(0, mine)
        if total % mine:
            raise ValueError(f"kvzap: the surrogate predicts {total} KV heads, this rank holds {mine}")
        from sglang_vericache.distributed.parallel_state import get_tp_group

        rank = get_tp_group().rank
        return slice(rank * mine, (rank + 1) * mine)

    def query_window(self, layer_id: int) -> int:
        return self.config.chunk_size

    def select(self, layer_id, k, q, positions):
        t = self.config.chunk_size
        want = (*k.shape[:-3], t, self.surrogate.hidden_size)  # (loads the surrogate, sets self.heads)
        h = None if q is None else q.flatten(-2) if q.dim() == k.dim() else q
        if h is None or tuple(h.shape) != want:
            raise ValueError(f"kvzap: needs the chunk's hidden states {list(want)}, got "
                             f"{None if q is None else list(q.shape)}")
        scores = self.surrogate.predict(layer_id, h)[..., self.heads].transpose(-1, -2)  # [..., H_kv, T]
        if positions is not None:
            sink = (positions.to(k.device) < self.config.num_sink_tokens).unsqueeze(-2)
            scores = torch.where(sink, float("inf"), scores)
        return top_k_indices(scores, self.rows(layer_id))

    def segment_queries(self, layer_id: int) -> int:
        return 2  # each token's own hidden state

    def segment_keep(self, layer_id, k, v, q, q_positions, positions):
        return top_k_indices(self.segment_scores(layer_id, k, v, q, q_positions, positions), self.kept(layer_id, k))

    def segment_scores(self, layer_id, k, v, q, q_positions, positions):
        """The surrogate's scores [H_kv, S] of the segment's own hidden states (sinks +inf)."""
        num_tokens = k.shape[0]
        h = None if q is None else q.flatten(-2) if q.dim() == 3 else q
        if h is None or len(h) < num_tokens or h.shape[-1] != self.surrogate.hidden_size:
            raise ValueError(f"kvzap: a segment needs its own hidden states [{num_tokens}, hidden]")
        scores = self.surrogate.predict(layer_id, h[:num_tokens])[..., self.heads].transpose(-1, -2)
        sink = (positions < self.config.num_sink_tokens).unsqueeze(0)
        return torch.where(sink, float("inf"), scores)
