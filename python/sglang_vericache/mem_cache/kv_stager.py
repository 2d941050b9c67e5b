"""LayerwiseKVStager: stream a verification's exact KV from the host pool layer by layer.

The exact pool is the host tier. Verifying needs, per layer, the exact K/V of the verifying
requests' committed prefixes; instead of copying all layers up front, the stager keeps a ring of
`depth` device-side staging slots, each holding one layer's K and V for up to `max_tokens` tokens:

    begin(slots)   submit the copies of layers 0 .. depth-1 (rows `slots` of the pool, in order)
    layer(l)       wait for layer l's copy -> (k [n, Hkv, D], v [n, Hkv, Dv]) views of its ring slot
    release(l)     free layer l's ring slot and submit layer l + depth into it

so layer l+1 (and l+2 ...) load while layer l computes. Layer l lives in ring slot l % depth.

Invariants (per StagedKV):
  - at most `depth` layers are staged or in flight at once (submitted - released <= depth);
  - every layer 0..L-1 is copied exactly once, in layer order; layers are released in order;
  - the link is charged n * bytes_per_token_layer() bytes per layer (K and V);
  - one StagedKV per stager at a time (they share the ring): begin() again only after the previous
    one released its last layer or was close()d;
  - n <= max_tokens, else begin() raises (the scheduler budgets staging rows).
Staging memory: staging_bytes() = depth * max_tokens * num_kv_heads * (head_dim + v_head_dim) * elem.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool
    from sglang_vericache.mem_cache.transfer_engine import TransferEngine, TransferHandle


class LayerwiseKVStager:
    def __init__(self, exact_pool: MHATokenToKVPool, transfer_engine: TransferEngine, max_tokens: int,
                 depth: int = 2):
        if depth < 1 or max_tokens < 1:
            raise ValueError(f"depth and max_tokens must be >= 1, got {depth}, {max_tokens}")
        p = exact_pool
        self.exact_pool, self.engine = p, transfer_engine
        self.max_tokens, self.depth = max_tokens, depth
        self.num_layers = p.num_layers
        dev = transfer_engine.device
        shape = (depth, max_tokens, p.num_kv_heads)
        self.k_ring = torch.zeros((*shape, p.head_dim), dtype=p.dtype, device=dev)
        self.v_ring = torch.zeros((*shape, p.v_head_dim), dtype=p.dtype, device=dev)
        # The exact pool on the host and the ring on the device (CUDA): gather on the host into
        # page-locked bounce buffers, then one non_blocking H2D copy per tensor on the copy stream.
        # An exact pool where the ring is (a CPU, or the device) gathers straight into the ring.
        self.k_bounce = self.v_bounce = None
        if p.get_key_buffer(0).device != self.k_ring.device:
            pin = transfer_engine.stream.pin_memory
            self.k_bounce = host_buffer(self.k_ring.shape, p.dtype, pin)
            self.v_bounce = host_buffer(self.v_ring.shape, p.dtype, pin)
        self._active: StagedKV | None = None
        # (start, end) of every wait of the compute thread on a layer still in flight.
        self.stalls: deque[tuple[float, float]] = deque(maxlen=1 << 17)

    def bytes_per_token_layer(self) -> int:
        """Bytes of one token's K + V in one layer (what the link moves per staged row per layer)."""
        p = self.exact_pool
        return p.num_kv_heads * (p.head_dim + p.v_head_dim) * self.k_ring.element_size()

    def staging_bytes(self) -> int:
        """Device memory the ring holds: depth * max_tokens * bytes_per_token_layer()."""
        return self.depth * self.max_tokens * self.bytes_per_token_layer()

    def transfer_bytes(self, n: int) -> int:
        """Link bytes of one begin() of n rows: n * bytes_per_token_layer() * num_layers."""
        return n * self.bytes_per_token_layer() * self.num_layers

    def begin(self, slots: torch.Tensor) -> StagedKV:
        """Start streaming the exact KV of pool slots `slots` (int64 [n], in the row order wanted)."""
        if slots.dim() != 1 or slots.dtype != torch.int64:
            raise ValueError(f"slots must be a 1-D int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
        n = len(slots)
        if n > self.max_tokens:
            raise ValueError(
                f"{n} staged tokens exceed the stager's max_tokens={self.max_tokens}: the scheduler must "
                "budget the verifying requests' context to the staging area"
            )
        if self._active is not None:
            raise RuntimeError("a StagedKV is still active on this stager: release its layers or close() it")
        self._active = staged = StagedKV(self, slots.to(self.exact_pool.device))
        for layer in range(min(self.depth, self.num_layers)):
            staged._submit(layer)
        return staged

    def _copy_fn(self, layer: int, ring: int, slots: torch.Tensor):
        p, n = self.exact_pool, len(slots)
        k_src, v_src = p.get_key_buffer(layer), p.get_value_buffer(layer)
        k_dst, v_dst = self.k_ring[ring, :n], self.v_ring[ring, :n]
        if self.k_bounce is None:  # the pool is where the ring is (CPU, or the device): gather straight in
            def copy() -> None:
                torch.index_select(k_src, 0, slots, out=k_dst)
                torch.index_select(v_src, 0, slots, out=v_dst)
        else:
            k_b, v_b = self.k_bounce[ring, :n], self.v_bounce[ring, :n]

            def copy() -> None:  # runs on the engine's side stream
                torch.index_select(k_src, 0, slots, out=k_b)
                torch.index_select(v_src, 0, slots, out=v_b)
                k_dst.copy_(k_b, non_blocking=True)
                v_dst.copy_(v_b, non_blocking=True)
        return copy


def host_buffer(shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host-side buffer of the link, page-locked where copies from it are asynchronous (CUDA)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


class StagedKV:
    """One verification's exact KV rows, streamed layer by layer (see LayerwiseKVStager)."""

    def __init__(self, stager: LayerwiseKVStager, slots: torch.Tensor):
        self.stager = stager
        self.slots = slots
        self.num_tokens = len(slots)
        self.num_layers = stager.num_layers
        self._handles: dict[int, TransferHandle] = {}  # submitted, not yet released
        self._waited: set[int] = set()  # layers the compute stream was ordered after (layer() called)
        self._next_submit = 0
        self._next_release = 0

    @property
    def in_flight(self) -> int:
        """Layers staged or being copied now (<= depth)."""
        return len(self._handles)

    def _submit(self, layer: int) -> None:
        st = self.stager
        assert layer == self._next_submit and len(self._handles) < st.depth, "ring invariant"
        nbytes = self.num_tokens * st.bytes_per_token_layer()
        fn = st._copy_fn(layer, layer % st.depth, self.slots)
        self._handles[layer] = st.engine.submit(fn, nbytes, tag=f"L{layer}")
        self._next_submit += 1

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for layer `layer`'s copy -> (k [n, Hkv, D], v [n, Hkv, Dv]); valid until release(layer)."""
        h = self._handles.get(layer)
        if h is None:
            raise RuntimeError(f"layer {layer} is not staged (staged now: {sorted(self._handles)})")
        if layer not in self._waited:
            # The compute stream waits for the copy's event (a CPU: the copy is done by then).
            t0, stalled = time.perf_counter(), not h.ready()
            h.wait()
            if stalled:  # compute stalled on the link: recorded for busy fractions and timelines
                self.stager.stalls.append((t0, time.perf_counter()))
            self._waited.add(layer)
        ring, n = layer % self.stager.depth, self.num_tokens
        return self.stager.k_ring[ring, :n], self.stager.v_ring[ring, :n]

    def release(self, layer: int) -> None:
        """Done reading layer `layer`: free its ring slot, submit layer + depth. In layer order."""
        if layer != self._next_release or layer not in self._handles:
            raise RuntimeError(f"release({layer}) out of order: next to release is {self._next_release}")
        h = self._handles.pop(layer)
        if layer not in self._waited:  # never read: still surface its copy's error
            h.wait()
        self._waited.discard(layer)
        self._next_release += 1
        if self._next_submit < self.num_layers:
            self._submit(self._next_submit)
        if self._next_release == self.num_layers:
            self._deactivate()

    def close(self) -> None:
        """Abandon the rest (e.g. the forward failed): wait out the copies in flight, free the ring.
        Idempotent; a no-op after the last layer was released."""
        for h in self._handles.values():
            h._done.wait()
        self._handles.clear()
        self._next_release = self._next_submit = self.num_layers
        self._deactivate()

    @property
    def finished(self) -> bool:
        return self._next_release == self.num_layers

    def _deactivate(self) -> None:
        if self.stager._active is self:
            self.stager._active = None
