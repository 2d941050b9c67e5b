"""KV memory: request -> token-slot map, the paged slot allocator, and the per-layer KV buffers.

A *slot* is one token's KV in every layer. Slots come in pages of `page_size`; slot
`s` lives in page `s // page_size`. Page 0 is reserved as padding (slot 0 is the dummy
slot that padded positions write to), so a real slot is never 0.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """req_to_token[req_pool_idx, pos] = the slot holding position `pos` of that request."""

    def __init__(self, size: int, max_context_len: int, device: str = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self.free_slots = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free(self, idx: int) -> None:
        self.free_slots.append(idx)

    def write(self, idx: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[idx, start : start + len(slots)] = slots


class PagedTokenAllocator:
    """Hands out KV slots a page at a time. Capacity is counted in tokens (= pages * page_size)."""

    def __init__(self, num_pages: int, page_size: int, device: str = "cpu"):
        self.page_size = page_size
        self.num_pages = num_pages  # usable pages, page ids 1..num_pages
        self.device = device
        # Called with the page ids given back (None: all of them, clear()); the accelerator's page cache
        # of a host exact pool drops its copies (mem_cache/device_page_cache.py).
        self.on_free = None
        self.clear()

    def clear(self) -> None:
        self.free_pages: list[int] = list(range(self.num_pages, 0, -1))  # pop() takes the lowest id
        if self.on_free is not None:
            self.on_free(None)

    @property
    def size(self) -> int:
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc_pages(self, n: int) -> list[int] | None:
        if n > len(self.free_pages):
            return None
        return [self.free_pages.pop() for _ in range(n)]

    def free_page_ids(self, pages: list[int]) -> None:
        self.free_pages.extend(pages)
        if self.on_free is not None:
            self.on_free(pages)

    def free(self, slots: torch.Tensor) -> None:
        """Frees the pages that `slots` start. Only call with page-aligned runs of whole pages."""
        if len(slots) == 0:
            return
        pages = (slots[:: self.page_size] // self.page_size).tolist()
        self.free_page_ids(pages)

    def alloc_extend(self, last_slot: int, cur_len: int, num_new: int) -> torch.Tensor | None:
        """Slots for positions cur_len..cur_len+num_new-1 of one request.

        Invariant: a request owns whole pages; positions p and p+1 share a page unless
        (p+1) % page_size == 0. `last_slot` is the slot of position cur_len-1 (ignored when
        cur_len is page-aligned). Returns None (allocating nothing) if pages run out.
        """
        ps = self.page_size
        in_last = (ps - cur_len % ps) % ps  # free slots left in the request's last page
        from_last = min(in_last, num_new)
        rest = num_new - from_last
        new_pages = self.alloc_pages((rest + ps - 1) // ps)
        if new_pages is None:
            return None
        parts = []
        if from_last:
            parts.append(torch.arange(last_slot + 1, last_slot + 1 + from_last, dtype=torch.int64))
        if new_pages:
            page_slots = torch.tensor(new_pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)
            parts.append(page_slots.flatten()[:rest])
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(parts).to(self.device)

    def pages_needed(self, cur_len: int, num_new: int) -> int:
        ps = self.page_size
        in_last = (ps - cur_len % ps) % ps
        return (max(0, num_new - in_last) + ps - 1) // ps


class MHATokenToKVPool:
    """Per-layer K and V buffers of shape [num_slots, num_kv_heads, head_dim]."""

    # set_kv_buffer is a copy into k_buffer / v_buffer at loc: a fused CPU decode layer may write them
    # itself (layers/attention/cpu_decode.py). Read from this class's own namespace: a subclass must say so.
    in_place_kv_writes = True

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str = "cpu",
        v_head_dim: int | None = None,
        pin_memory: bool = False,
    ):
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype = dtype
        self.device = device
        pin = dict(pin_memory=True) if pin_memory else {}  # host memory that CUDA copies from asynchronously
        self.k_buffer = [
            torch.zeros((num_slots, num_kv_heads, head_dim), dtype=dtype, device=device, **pin)
            for _ in range(num_layers)
        ]
        self.v_buffer = [
            torch.zeros((num_slots, num_kv_heads, self.v_head_dim), dtype=dtype, device=device, **pin)
            for _ in range(num_layers)
        ]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_buf, v_buf = self.k_buffer[layer_id], self.v_buffer[layer_id]
        loc = loc.to(k_buf.device)  # index_copy_ wants index and source on the buffer's device
        k_buf.index_copy_(0, loc, k.to(k_buf.device, self.dtype))
        v_buf.index_copy_(0, loc, v.to(v_buf.device, self.dtype))

    def bytes_per_token(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.v_head_dim) * elem
