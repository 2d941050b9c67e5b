"""The compressed KV tier: a pool of compressed chunks, one chunk = one KV page of one sequence.

A chunk id names one page's compressed KV in *every* layer (like a slot names one token's exact
KV in every layer). Per layer l and per TensorSpec s of `compressor.layout(l)` the pool holds a
buffer `[num_chunks + 1, *s.shape]`; chunk id 0 is padding and never handed out, so a real id is
never 0. The pool lives in "device" memory with its own budget, apart from the exact pool
(MHATokenToKVPool), which in VeriCache mode plays the host pool.

Where every layer has the same layout, the L buffers of a tensor are slices of one `flat` buffer
`[L * (num_chunks + 1), *s.shape]`: chunk id c of layer l is flat chunk l * (num_chunks + 1) + c
(`layer_chunks`). Global budgets (compress/head_budget.py) deal a segment's L * n flat chunks to the
layers by their budgets, so a layer's chunks are then any of its ids' flat chunks, in any layer's slice;
the request keeps which (TwoTierKV, Req.comp_layer_chunks) and draft attention reads them from `flat`.

Ownership mirrors the exact tier: ids in the radix tree belong to the tree (freed by its
eviction); a request owns the ids it allocated itself until it inserts them or frees them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang_vericache.compress.base import CompressedChunk, KVCompressor, Layout

if TYPE_CHECKING:
    from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool


class CompressedKVPool:
    def __init__(self, compressor: KVCompressor, num_layers: int, num_chunks: int, device: str = "cpu"):
        assert num_chunks >= 0
        self.compressor = compressor
        self.num_layers = num_layers
        self.num_chunks = num_chunks  # usable ids 1..num_chunks
        self.device = device
        self.chunk_size = compressor.config.chunk_size  # exact tokens per chunk (= page_size)
        self.layouts: list[Layout] = [compressor.layout(i) for i in range(num_layers)]
        self._chunk_bytes = sum(lay.chunk_nbytes() for lay in self.layouts)  # read at every iteration
        self.flat: dict[str, torch.Tensor] | None = None  # every layer's buffer as one (module docstring)
        if all(lay == self.layouts[0] for lay in self.layouts):
            self.flat = {s.name: torch.zeros((num_layers * (num_chunks + 1), *s.shape), dtype=s.dtype, device=device)
                         for s in self.layouts[0].tensors}
            self.buffers: list[dict[str, torch.Tensor]] = [
                {name: buf[i * (num_chunks + 1) : (i + 1) * (num_chunks + 1)] for name, buf in self.flat.items()}
                for i in range(num_layers)
            ]
        else:
            self.buffers = [
                {s.name: torch.zeros((num_chunks + 1, *s.shape), dtype=s.dtype, device=device)
                 for s in lay.tensors}
                for lay in self.layouts
            ]
        self.clear()

    @staticmethod
    def chunks_for_budget(compressor: KVCompressor, num_layers: int, budget_bytes: int) -> int:
        """How many chunks a byte budget holds (padding chunk not counted)."""
        per_chunk = sum(compressor.layout(i).chunk_nbytes() for i in range(num_layers))
        return int(budget_bytes // per_chunk)

    # ------------------------------------------------------------------ allocator

    def clear(self) -> None:
        """Every id free again. Does not zero the buffers."""
        self.free_ids = torch.arange(1, self.num_chunks + 1, dtype=torch.int64)
        self._is_free = torch.ones(self.num_chunks + 1, dtype=torch.bool)
        self._is_free[0] = False  # padding is never free, never freed

    def available_chunks(self) -> int:
        return len(self.free_ids)

    def alloc(self, n: int) -> torch.Tensor | None:
        """n ids from the front of the free list (lowest first on a fresh pool); None, taking
        nothing, if fewer than n are free."""
        if n > len(self.free_ids):
            return None
        ids, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        self._is_free[ids] = False
        return ids.clone()

    def free(self, ids: torch.Tensor) -> None:
        """Returns ids to the back of the free list. Each id must be allocated (no double free)."""
        if len(ids) == 0:
            return
        ids = ids.to(torch.int64).cpu()
        bad = self._is_free[ids].any() or int(ids.min()) <= 0
        assert not bad, f"freeing free or padding ids {ids.tolist()}"
        assert len(torch.unique(ids)) == len(ids), f"duplicate ids in free {ids.tolist()}"
        self._is_free[ids] = True
        self.free_ids = torch.cat([self.free_ids, ids])

    # ------------------------------------------------------------------ data

    def write(self, layer_id: int, ids: torch.Tensor, chunk: CompressedChunk) -> None:
        """Stores chunk (batched, leading dim len(ids)) under ids in layer layer_id."""
        layout = self.layouts[layer_id]
        assert chunk.matches(layout), f"chunk does not match layer {layer_id}'s layout"
        assert chunk.batch_shape(layout) == (len(ids),), f"{chunk.batch_shape(layout)=} for {len(ids)} ids"
        _copy_in(self.buffers[layer_id], ids.to(self.device), chunk, self.device)

    def layer_chunks(self, layer_id: int, ids: torch.Tensor) -> torch.Tensor:
        """The flat chunks of ids in layer layer_id's buffer (the module docstring)."""
        return ids.to(torch.int64) + layer_id * (self.num_chunks + 1)

    def write_flat(self, flat_ids: torch.Tensor, chunk: CompressedChunk) -> None:
        """Stores chunk (batched, leading dim len(flat_ids)) under flat chunks flat_ids."""
        assert self.flat is not None, "the layers' layouts differ: no flat buffer"
        assert chunk.matches(self.layouts[0]) and chunk.batch_shape(self.layouts[0]) == (len(flat_ids),)
        _copy_in(self.flat, flat_ids.to(self.device), chunk, self.device)

    def read(self, layer_id: int, ids: torch.Tensor) -> CompressedChunk:
        """The chunks under ids (a copy), batched with leading dim len(ids), in the order of ids."""
        ids = ids.to(self.device)
        # index_select: advanced indexing of int8/uint8 buffers is ~20x slower on CPU.
        return CompressedChunk({name: _index_select(buf, ids) for name, buf in self.buffers[layer_id].items()})

    def decompress(self, layer_id: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (k, v), each [len(ids) * rows_l, H_kv, D]: the rows of chunk ids[0], then
        ids[1], ... (what drafting attention over this prefix reads; RoPE already applied)."""
        c = self.compressor.config
        if len(ids) == 0:
            empty = torch.empty((0, c.num_kv_heads, c.head_dim), dtype=torch.float32, device=self.device)
            return empty, empty.clone()
        k, v = self.compressor.decompress(layer_id, self.read(layer_id, ids))
        return k.flatten(0, 1), v.flatten(0, 1)

    # ------------------------------------------------------------------ sizes

    def bytes_per_chunk(self) -> int:
        """Stored bytes of one chunk id, summed over layers (scales and indices included)."""
        return self._chunk_bytes

    def size_bytes(self) -> int:
        """Bytes the buffers take, the padding chunk included."""
        return sum(b.numel() * b.element_size() for bufs in self.buffers for b in bufs.values())


def _copy_in(buffers: dict[str, torch.Tensor], ids: torch.Tensor, chunk: CompressedChunk, device) -> None:
    for name, buf in buffers.items():
        src = chunk[name].to(device)
        if buf.element_size() == 1:  # CPU index_copy_ lacks float8: copy the bytes
            buf, src = buf.view(torch.uint8), src.view(torch.uint8)
        buf.index_copy_(0, ids, src)


def _index_select(buf: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if buf.element_size() == 1:  # one-byte dtypes (incl. float8) gather as bytes
        return buf.view(torch.uint8).index_select(0, ids).view(buf.dtype)
    return buf.index_select(0, ids)


def compress_pages(
    compressor: KVCompressor,
    kv_pool: MHATokenToKVPool,
    compressed_pool: CompressedKVPool,
    slots: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor | None = None,
    queries: list[torch.Tensor | None] | None = None,
) -> None:
    """Compresses whole pages of exact KV, every layer, into the (already allocated) chunk ids.

    slots:     [n * T] int64 exact slots; chunk i is slots[i*T:(i+1)*T] (T = chunk_size = page_size),
               e.g. a node's value or a run of req_to_token.
    ids:       [n] chunk ids to write; chunk i goes to ids[i].
    positions: [n * T] absolute positions of those tokens (StreamingLLM needs them; pass always).
    queries:   per layer l, None if compressor.query_window(l) == 0, else [n, W_l, H_q, D] the
               post-RoPE queries of the LAST W_l tokens of each chunk (W_l = query_window(l); H2O
               uses W_l = T, all of them). Queries are not stored anywhere, so a query-based
               method (snapkv, pyramidkv, h2o) can compress only inside the forward pass that
               computed the page (prefill/verify); rebuilding its chunks from the exact tier alone
               needs that forward to be recomputed. Query-free methods rebuild from exact KV.
               kvzip (compressor.needs_reconstruction): per layer a kvzip.ReconstructionPass of the
               n chunks (q [n, R, H_q, D], k [n, R, H_kv, D]), the model runner's extra forward.
    Chunk-local and deterministic: the same pages give the same bytes wherever they are stored.
    """
    t = compressor.config.chunk_size
    n = len(ids)
    assert len(slots) == n * t, f"{len(slots)=} is not {n} chunks of {t}"
    assert kv_pool.num_layers == compressed_pool.num_layers
    if n == 0:
        return
    slots = slots.to(kv_pool.device)
    pos = None if positions is None else positions.reshape(n, t)
    dev = compressed_pool.device  # the compressor runs where its pool is (a host exact pool: pages copied in)
    for layer in range(kv_pool.num_layers):
        k = kv_pool.get_key_buffer(layer)[slots].unflatten(0, (n, t)).to(dev)  # [n, T, H_kv, D]
        v = kv_pool.get_value_buffer(layer)[slots].unflatten(0, (n, t)).to(dev)
        q = None
        if compressor.query_window(layer) > 0 or compressor.needs_reconstruction:
            if queries is None or queries[layer] is None:
                what = "a ReconstructionPass" if compressor.needs_reconstruction else "queries [n, W, H_q, D]"
                raise ValueError(f"{compressor.name} needs {what} for layer {layer}")
            q = queries[layer]
        chunk = compressor.compress(layer, k, v, q=q, positions=pos)
        compressed_pool.write(layer, ids, chunk)


def compress_segment(
    compressor: KVCompressor,
    kv_pool: MHATokenToKVPool,
    compressed_pool: CompressedKVPool,
    slots: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    queries: list[torch.Tensor | None] | None = None,
    q_positions: torch.Tensor | None = None,
) -> list[torch.Tensor] | None:
    """Compresses n whole pages of exact KV as ONE segment, every layer, into the chunk ids:
    the compressor ranks the segment's tokens together and deals k_l kept rows per head to each
    chunk (TokenDropCompressor.compress_segment).

    slots, positions: [n * T] the segment's exact slots and absolute positions; ids: [n].
    queries:   per layer, None if compressor.segment_queries(l) == 0, else the queries [Q, H_q, D]
               (kvzap: hidden states [Q, hidden]) at q_positions [Q], from the segment's start on.
    Returns None, or where the compressor deals a segment's chunks to the layers (compressor.deals_layers:
    global head budgets, PyramidKV's per-segment budgets) each layer's flat chunks (the module docstring).
    """
    t = compressor.config.chunk_size
    n = len(ids)
    assert len(slots) == n * t == len(positions), f"{len(slots)=} is not {n} chunks of {t}"
    slots = slots.to(kv_pool.device)
    dev = compressed_pool.device
    ranked = {}  # dealt layers: layer -> (k, v, its ranked scores)
    for layer in range(kv_pool.num_layers):
        k = kv_pool.get_key_buffer(layer)[slots].to(dev)  # [n * T, H_kv, D]
        v = kv_pool.get_value_buffer(layer)[slots].to(dev)
        q = None if queries is None else queries[layer]
        if compressor.segment_queries(layer) and q is None:
            raise ValueError(f"{compressor.name} needs the segment's queries for layer {layer}")
        if getattr(compressor, "deals_layers", False) and not compressor.sliding(layer):
            ranked[layer] = (k, v, compressor.ranked_scores(layer, k, v, q, q_positions, positions.to(dev)))
            continue
        chunk = compressor.compress_segment(layer, k, v, q=q, q_positions=q_positions, positions=positions)
        compressed_pool.write(layer, ids, chunk)
    if not ranked:
        return None
    return _write_dealt(compressor, compressed_pool, ids, ranked)


def _write_dealt(compressor, pool: CompressedKVPool, ids: torch.Tensor, ranked: dict) -> list[torch.Tensor]:
    """The segment's flat chunks of the dealt layers (a sliding layer keeps its own), in (layer, id) order,
    handed to them in layer order, c_l each (compressor.deal_layers), and their chunks written there."""
    dealt = compressor.deal_layers(ranked, len(ids))
    free = torch.cat([pool.layer_chunks(layer, ids) for layer in sorted(ranked)])
    chunks = [pool.layer_chunks(layer, ids) for layer in range(pool.num_layers)]
    start = 0
    for layer in sorted(ranked):
        c, chunk = dealt[layer]
        chunks[layer] = free[start : start + c]
        start += c
        if c:
            pool.write_flat(chunks[layer], chunk)
    return chunks
