"""ExactPlacement: which running requests keep their exact KV in device memory (ARCHITECTURE.md 11).

One device budget holds the compressed tier (the chunks in use), the drafts' scratch KV (per
request that drafts), the staging ring (only while some request's exact KV is on the host), and
whatever is left holds exact KV of running requests: those are *resident* and
verify (or decode) over it with no link; the others' exact KV lives in the host tier and streams
over the link at each verification.

Rule (stable, so requests do not flap between tiers): in admission order, a request is resident
while the resident requests' exact KV (committed positions plus one round of growth) fits what is
left; a request that stops fitting (the compressed tier grew) is demoted, newest first. Demotion
costs nothing (the host tier is written through: it holds every committed position); promotion
moves the request's exact KV over the link once (charged to the transfer engine), and the request
counts as resident only when that copy is done. A request placed for the first time (right after
its prefill, whose exact KV was computed on the device) is resident at once if it fits.

Compressed chunks the radix cache keeps for finished requests (evictable, nobody's tier) do not
count against the budget: they are evicted when resident exact KV needs their room, as full mode's
cache gives way to running requests.

Without a device budget (no --device-kv-budget and no device memory limit) every request is
resident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from sglang_vericache.mem_cache.compressed_pool import CompressedKVPool
    from sglang_vericache.mem_cache.transfer_engine import TransferEngine, TransferHandle


@dataclass
class Residency:
    resident: bool = False
    promoting: TransferHandle | None = None  # the copy onto the device, while in flight


class ExactPlacement:
    def __init__(self, device_bytes: int | None, comp_pool: CompressedKVPool, kv_bytes_per_token: int,
                 growth_tokens: int, scratch_bytes_per_drafter: int = 0, staging_bytes: int = 0,
                 engine: TransferEngine | None = None, tree_cache: Callable[[], Any] | None = None):
        self.device_bytes = device_bytes
        self.scratch = scratch_bytes_per_drafter
        self.staging = staging_bytes
        self.comp_pool = comp_pool
        self.kv_bytes = kv_bytes_per_token
        self.growth = growth_tokens
        self.engine = engine
        self.tree_cache = tree_cache  # -> the two-tier radix cache (comp_evictable_chunks, evict_compressed)
        self.state: dict[str, Residency] = {}  # rid -> residency, for running requests
        self.stats = {"promotions": 0, "demotions": 0, "promoted_bytes": 0}

    def free_bytes(self, drafters: int = 0, staging: bool = False, evictable: bool = True) -> float:
        """Device bytes left for resident exact KV, with `drafters` requests that may draft and
        (staging) the staging ring held; evictable: the radix cache's evictable chunks count as free."""
        if self.device_bytes is None:
            return float("inf")
        held = self.comp_pool.num_chunks - self.comp_pool.available_chunks()
        if evictable:
            held -= self._cache_chunks()
        used = held * self.comp_pool.bytes_per_chunk()
        return self.device_bytes - used - drafters * self.scratch - (self.staging if staging else 0)

    def _cache_chunks(self) -> int:
        tree = self.tree_cache() if self.tree_cache is not None else None
        return tree.comp_evictable_chunks() if tree is not None else 0

    def _make_room(self, need: float, drafters: int, staging: bool) -> None:
        """Evicts cached compressed chunks until `need` bytes of resident exact KV fit."""
        short, cached = need - self.free_bytes(drafters, staging, evictable=False), self._cache_chunks()
        if short > 0 and cached:
            self.tree_cache().evict_compressed(min(cached, -(-int(short) // self.comp_pool.bytes_per_chunk())))

    def exact_bytes(self, committed: int) -> int:
        return (committed + self.growth) * self.kv_bytes

    def update(self, running: list) -> list[bool]:
        """Re-places the running requests (each with .rid, .kv_committed_len and .spec.decode_only,
        in admission order); -> whether each is resident now."""
        live = {r.rid for r in running}
        for rid in [rid for rid in self.state if rid not in live]:
            del self.state[rid]
        sizes = [self.exact_bytes(r.kv_committed_len) for r in running]
        drafters = sum(1 for r in running if not r.spec.decode_only)  # decode-only requests never draft
        staging = False
        wanted = residency(sizes, self.free_bytes(drafters))
        if not all(wanted):  # some exact KV stays on the host: the staging ring takes its room
            staging = True
            wanted = residency(sizes, self.free_bytes(drafters, staging=True))
        self._make_room(sum(b for b, w in zip(sizes, wanted) if w), drafters, staging)
        out = []
        for r, want in zip(running, wanted):
            st = self.state.get(r.rid)
            if st is None:  # first placement, right after its prefill: its exact KV is on the device
                st = self.state[r.rid] = Residency(resident=want)
            elif not want:
                if st.resident or st.promoting is not None:
                    self.stats["demotions"] += 1
                st.resident, st.promoting = False, None
            elif not st.resident:
                if st.promoting is None:
                    st.promoting = self._promote(r)
                if st.promoting is None or st.promoting.done():
                    st.resident, st.promoting = True, None
                    self.stats["promotions"] += 1
            out.append(st.resident)
        return out

    def _promote(self, req) -> TransferHandle | None:
        """A request whose exact KV exists only on the host gets it copied over the link once."""
        if self.engine is None or self.engine.bandwidth is None:
            return None
        nbytes = req.kv_committed_len * self.kv_bytes
        self.stats["promoted_bytes"] += nbytes
        return self.engine.submit(lambda: None, nbytes, tag="promote")


def residency(exact_bytes: list[int], free_bytes: float) -> list[bool]:
    """In the given (admission) order, whether each request's exact KV fits what is left after the
    ones before it that fit: a stable rule, a request never loses its place to a later one."""
    out, used = [], 0
    for b in exact_bytes:
        fits = used + b <= free_bytes
        out.append(fits)
        if fits:
            used += b
    return out
