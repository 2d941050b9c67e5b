"""Composition `DROP+QUANT` (`--kv-compressor snapkv+kivi4`): drop tokens, then quantize what is kept.

A composed chunk of layer l is the quantizer's chunk of the dropper's k_l kept rows: its layout
is "quantized" with rows = k_l, and its tensors are the quantizer's for a chunk of k_l rows (no
kept-index tensor: RoPE is in the keys already, and attention over the compressed tier is a
plain softmax over the rows, so which token a row came from is not needed). So the tier shrinks
by both factors, e.g. 4 x 3.2 for snapkv at ratio 4 with kivi4, and the backends read it like
any quantized layout (a kivi / int8 / fp8 quantizer's, with k_l rows, is the fused CPU kernel's).

Over a segment (compress_segment: a prompt after its prefill, a run of generated tokens) the dropper
selects over the whole segment and deals its kept tokens k_l to a chunk, then each chunk is quantized.

Row j of head h is that head's j-th kept token, so a quantizer that groups rows (kivi's key
groups) groups each head's kept tokens in order, and one that needs positions (kvquant, rotatekv:
pre-RoPE keys) gets each row's own, per head ([k_l, H]).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from sglang_vericache.compress.base import CompressedChunk, KVCompressor, Layout
from sglang_vericache.compress.token_drop import TokenDropCompressor, check_segment, deal


class ComposedCompressor(KVCompressor):
    def __init__(self, config, drop: TokenDropCompressor, quantizer: Callable[[int], KVCompressor]):
        """quantizer(rows) -> the quantizer for chunks of `rows` rows (one per distinct k_l)."""
        super().__init__(config)
        self.name = config.name
        self.drop = drop
        self.stages: dict[int, KVCompressor] = {}
        for layer in range(config.num_layers):
            rows = drop.rows(layer)
            if rows not in self.stages:
                self.stages[rows] = quantizer(rows)

    def stage(self, layer_id: int) -> KVCompressor:
        return self.stages[self.drop.rows(layer_id)]

    def layout(self, layer_id: int) -> Layout:
        rows = self.drop.rows(layer_id)
        inner = self.stage(layer_id).layout(layer_id)
        return Layout(kind="quantized", chunk_size=self.config.chunk_size, rows=rows, tensors=inner.tensors)

    def query_window(self, layer_id: int) -> int:
        return self.drop.query_window(layer_id)

    @property
    def needs_reconstruction(self) -> bool:
        return self.drop.needs_reconstruction

    @property
    def reads_hidden(self) -> bool:
        return getattr(self.drop, "reads_hidden", False)

    @property
    def surrogate(self):
        return self.drop.surrogate

    def compress(self, layer_id, k, v, q=None, positions=None) -> CompressedChunk:
        self._check_kv(k, v)
        rows = self.drop.keep_chunk(layer_id, k, v, q, positions).transpose(-1, -2)  # [..., n, H]
        gather = rows[..., None].expand(*rows.shape, k.shape[-1])
        kept_k, kept_v = torch.gather(k, -3, gather), torch.gather(v, -3, gather)
        kept_pos = None
        if positions is not None:
            per_head = positions.to(k.device)[..., None].expand(*positions.shape, k.shape[-2])  # [..., T, H]
            kept_pos = torch.gather(per_head, -2, rows)
        return self.stage(layer_id).compress(layer_id, kept_k, kept_v, positions=kept_pos)

    def segment_queries(self, layer_id: int) -> int:
        return self.drop.segment_queries(layer_id)

    def compress_segment(self, layer_id, k, v, q=None, q_positions=None, positions=None) -> CompressedChunk:
        """The dropper's selection over the whole segment (k_l rows dealt to each of its n chunks),
        then each chunk's kept rows quantized as a chunk of k_l rows."""
        n = check_segment(self, k, v, positions)
        positions = positions.to(k.device)
        keep = self.drop.keep_segment(layer_id, k, v, q, q_positions, positions)
        rows = deal(keep, n, self.drop.rows(layer_id))  # [n, k_l, H]
        gather = rows.flatten(0, 1)[..., None].expand(-1, -1, k.shape[-1])
        kept_k = torch.gather(k, 0, gather).unflatten(0, rows.shape[:2])
        kept_v = torch.gather(v, 0, gather).unflatten(0, rows.shape[:2])
        return self.stage(layer_id).compress(layer_id, kept_k, kept_v, positions=positions[rows])

    def decompress(self, layer_id, chunk):
        return self.stage(layer_id).decompress(layer_id, chunk)


def compose(
    config, resolve: Callable[[str], tuple[type, dict]], drop_name: str, quant_name: str
) -> ComposedCompressor:
    """drop_name then quant_name, two registered names; resolve(name) -> (class, constructor kwargs)."""
    drop_cls, drop_kwargs = resolve(drop_name)
    drop = drop_cls(replace(config, name=drop_name), **drop_kwargs)
    if not isinstance(drop, TokenDropCompressor):
        raise ValueError(
            f"--kv-compressor {config.name}: {drop_name!r} does not drop tokens; a composition "
            "is a token-dropping compressor then a quantizer"
        )
    quant_cls, quant_kwargs = resolve(quant_name)

    def quantizer(rows: int) -> KVCompressor:
        cfg = replace(config, name=quant_name, chunk_size=rows)
        kwargs = dict(quant_kwargs)
        if quant_name.startswith("kivi") and rows > cfg.group_size and rows % cfg.group_size:
            kwargs["key_group"] = math.gcd(rows, cfg.group_size)  # key groups that tile the kept rows
        if getattr(quant_cls, "takes_kept_rows_positions", False):
            kwargs["per_head_positions"] = True
        stage = quant_cls(cfg, **kwargs)
        if stage.layout(0).kind != "quantized":
            raise ValueError(
                f"--kv-compressor {config.name}: {quant_name!r} is not a quantizer; a composition "
                "is a token-dropping compressor then a quantizer"
            )
        return stage

    return ComposedCompressor(config, drop, quantizer)
