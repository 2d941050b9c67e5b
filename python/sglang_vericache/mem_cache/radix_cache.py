"""Radix prefix cache: shares the KV of common prompt prefixes between requests.

A tree of token-id runs; each node owns the KV slots of its run. Everything is page-aligned:
every node's key and value have a length that is a multiple of `page_size`, children are keyed
by their first page, and a trailing partial page is never cached. Names and semantics follow
SGLang's `RadixCache` (python/sglang/srt/mem_cache/radix_cache.py).

Ownership: slots in the tree are owned by the tree (freed only by `evict`); a request owns the
slots it allocated itself and frees its duplicates when the tree already held the same prefix.
A request locks the path it uses (`inc_lock_ref`), so locked nodes are never evicted.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sglang_vericache.mem_cache.memory_pool import PagedTokenAllocator, ReqToTokenPool


class TreeNode:
    _next_id = 0

    def __init__(self, access_time: int = 0):
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent: TreeNode | None = None
        self.key: list[int] = []
        self.value: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.lock_ref = 0
        self.last_access_time = access_time  # the cache's logical clock, not wall time
        self.hit_count = 0
        self.id = TreeNode._next_id  # tie-breaker for deterministic eviction order
        TreeNode._next_id += 1

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass(frozen=True)
class MatchResult:
    device_indices: torch.Tensor  # int64 slots of the matched page-aligned prefix
    last_node: TreeNode  # deepest matched node (the root on a miss)


def evict_lru(leaves: list, need: int, free: Callable[[Any], int], next_leaf: Callable[[Any], Any]) -> int:
    """The loop of every tree eviction: frees the least recently used of leaves (free(node) -> units
    freed) until need units are freed; next_leaf(node) -> the parent that node's going made an
    evictable leaf, or None. Returns the units freed."""
    heap = [(n.last_access_time, n.id, n) for n in leaves]
    heapq.heapify(heap)
    freed = 0
    while freed < need and heap:
        _, _, node = heapq.heappop(heap)
        freed += free(node)
        parent = next_leaf(node)
        if parent is not None:
            heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
    return freed


class RadixCache:
    node_cls: type[TreeNode] = TreeNode  # subclasses may store more per node

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool | None,
        token_to_kv_pool_allocator: PagedTokenAllocator | None,
        page_size: int,
        disable: bool = False,
    ):
        assert page_size >= 1
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = disable
        self.device = getattr(token_to_kv_pool_allocator, "device", "cpu")
        self.reset()

    # ------------------------------------------------------------------ public API

    def reset(self) -> None:
        """Forgets the whole tree. Does not free slots: clear the allocator alongside."""
        self._clock = 0
        self.root_node = self.node_cls()
        self.root_node.lock_ref = 1  # the root is never evicted
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.num_queried_tokens = 0
        self.num_matched_tokens = 0

    def match_prefix(self, key: list[int], record_stats: bool = True) -> MatchResult:
        """Longest cached page-aligned prefix of `key`.

        Splits a node when the match ends inside it, so `last_node` ends exactly at the match.
        `record_stats` adds to the hit-rate counters (pass False for repeated look-ups).
        """
        key = list(key)
        if self.disable or len(key) < self.page_size:
            result = MatchResult(self._empty_indices(), self.root_node)
        else:
            result = self._match(self._page_aligned(key), count_hit=True)
        if record_stats:
            self.num_queried_tokens += len(key)
            self.num_matched_tokens += len(result.device_indices)
        return result

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Inserts `key` -> `value`; returns how many leading tokens were already in the tree.

        The caller keeps ownership of (and must free) its own slots for that leading range;
        the tree takes ownership of `value[returned:]`.
        """
        assert len(key) % self.page_size == 0, f"key length {len(key)} not page-aligned"
        assert len(key) == len(value), f"{len(key)=} != {len(value)=}"
        if self.disable or len(key) == 0:
            return 0
        return self._insert(list(key), value.to(torch.int64))

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Locks the path root..node; returns the change of evictable_size()."""
        return self._add_lock_ref(node, 1)

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Unlocks the path root..node; returns the change of evictable_size()."""
        return self._add_lock_ref(node, -1)

    def _add_lock_ref(self, node: TreeNode, d: int) -> int:
        if self.disable:
            return 0
        delta = 0
        while node is not self.root_node:
            assert node.lock_ref + d >= 0, f"dec_lock_ref on unlocked {node}"
            was_locked = node.lock_ref > 0
            node.lock_ref += d
            if (node.lock_ref > 0) != was_locked:
                sign = 1 if was_locked else -1  # +1: becomes evictable
                self.evictable_size_ += sign * len(node.key)
                self.protected_size_ -= sign * len(node.key)
                delta += sign * len(node.key)
            node = node.parent
        return delta

    def evict(self, num_tokens: int) -> int:
        """Frees least-recently-used unpinned leaves (and what goes with them, _on_evict) until
        >= num_tokens exact tokens are freed; returns the count."""
        if self.disable:
            return 0

        def free(node: TreeNode) -> int:
            self.token_to_kv_pool_allocator.free(node.value)
            self._on_evict(node)
            self._delete_leaf(node)
            return len(node.value)

        def next_leaf(node: TreeNode) -> TreeNode | None:
            parent = node.parent  # the root is pinned (lock_ref 1)
            return parent if not parent.children and not self._pinned(parent) else None

        leaves = [n for n in self._collect_leaves() if not self._pinned(n)]
        return evict_lru(leaves, num_tokens, free, next_leaf)

    def _pinned(self, node: TreeNode) -> bool:
        """Whether evict must keep node's exact KV: a request holds it."""
        return node.lock_ref > 0

    def _on_evict(self, node: TreeNode) -> None:
        """Called for each evicted leaf after its exact slots are freed (the two-tier tree drops its comp)."""

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        total, stack = 0, [self.root_node]
        while stack:
            node = stack.pop()
            total += len(node.value)
            stack.extend(node.children.values())
        return total

    def hit_rate(self) -> float:
        """Prefix-cache hit rate: tokens matched / tokens queried by match_prefix."""
        return self.num_matched_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def pretty_print(self) -> str:
        text = self._format()
        print(text)
        return text

    # ------------------------------------------------------------ request hooks
    #
    # Row `req_to_token[req.req_pool_idx]` of a request:
    #   [0, len(prefix_indices))            slots owned by the tree (path locked via last_node)
    #   [len(prefix_indices), kv_allocated) slots owned by the request, whole pages
    #   [0, kv_committed_len)               positions whose KV is computed
    # Only the page-aligned committed part L = floor(kv_committed_len / page) * page is cached.

    def cache_finished_req(self, req: Any) -> None:
        """Gives the request's KV to the tree (or frees it) and releases its row and lock."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        allocator = self.token_to_kv_pool_allocator
        if self.disable:
            allocator.free(row[: req.kv_allocated_len])
        else:
            n_prefix = len(req.prefix_indices)
            cached_len = self._page_floor(req.kv_committed_len)
            assert n_prefix <= cached_len, f"{n_prefix=} > {cached_len=}"
            slots = row[:cached_len].clone()
            n_old = self.insert(req.fill_ids[:cached_len], slots)
            assert n_old >= n_prefix, "the request's locked prefix left the tree"
            allocator.free(slots[n_prefix:n_old])  # duplicates of what the tree already had
            allocator.free(row[cached_len : req.kv_allocated_len])  # the uncached tail pages
            self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req: Any) -> None:
        """Shares the request's computed page-aligned KV; the request keeps running on it."""
        if self.disable:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        n_prefix = len(req.prefix_indices)
        cached_len = self._page_floor(req.kv_committed_len)
        assert n_prefix <= cached_len, f"{n_prefix=} > {cached_len=}"
        key = list(req.fill_ids[:cached_len])
        slots = row[:cached_len].clone()
        n_old = self.insert(key, slots)
        assert n_old >= n_prefix, "the request's locked prefix left the tree"
        self.token_to_kv_pool_allocator.free(slots[n_prefix:n_old])

        # Point the row at the tree's slots (replacing the duplicates just freed) and move the lock.
        match = self._match(key, count_hit=False)
        new_indices = match.device_indices
        assert len(new_indices) == cached_len, f"{len(new_indices)=} != {cached_len=}"
        self.req_to_token_pool.write(req.req_pool_idx, n_prefix, new_indices[n_prefix:])
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = new_indices
        req.last_node = match.last_node

    # ------------------------------------------------------------------ internals

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _page_floor(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def _page_aligned(self, key: list[int]) -> list[int]:
        return key[: self._page_floor(len(key))]

    def _child_key(self, key: list[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def _empty_indices(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _key_match_len(self, a: list[int], b: list[int]) -> int:
        """Length of the common prefix of a and b, rounded down to whole pages."""
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return self._page_floor(n)

    def _match(self, key: list[int], count_hit: bool) -> MatchResult:
        now = self._tick()
        node = self.root_node
        node.last_access_time = now
        values: list[torch.Tensor] = []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            if count_hit:
                child.hit_count += 1
            n = self._key_match_len(child.key, key)
            if n < len(child.key):
                node = self._split_node(child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node = child
            key = key[n:]
        indices = torch.cat(values) if values else self._empty_indices()
        return MatchResult(indices, node)

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Splits child into new_node (first split_len tokens) -> child (the rest)."""
        assert 0 < split_len < len(child.key) and split_len % self.page_size == 0
        new_node = self.node_cls(child.last_access_time)
        new_node.hit_count = child.hit_count
        new_node.lock_ref = child.lock_ref  # same lockers, so evictable/protected sizes are unchanged
        new_node.parent = child.parent
        new_node.key = child.key[:split_len]
        new_node.value = child.value[:split_len].clone()
        child.key = child.key[split_len:]
        child.value = child.value[split_len:].clone()
        child.parent = new_node
        new_node.children = {self._child_key(child.key): child}
        new_node.parent.children[self._child_key(new_node.key)] = new_node
        return new_node

    def _insert(self, key: list[int], value: torch.Tensor) -> int:
        now = self._tick()
        node = self.root_node
        node.last_access_time = now
        matched = 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._key_match_len(child.key, key)
            if n < len(child.key):
                child = self._split_node(child, n)
            matched += n
            key, value = key[n:], value[n:]
            node = child
        if key:
            new_node = self.node_cls(now)
            new_node.parent = node
            new_node.key = key
            new_node.value = value.clone()
            node.children[self._child_key(key)] = new_node
            self.evictable_size_ += len(key)
        return matched

    def _collect_leaves(self) -> list[TreeNode]:
        leaves, stack = [], [self.root_node]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root_node:
                leaves.append(node)
            stack.extend(node.children.values())
        return leaves

    def _delete_leaf(self, node: TreeNode) -> None:
        removed = node.parent.children.pop(self._child_key(node.key))
        assert removed is node
        self.evictable_size_ -= len(node.key)

    def _format(self) -> str:
        lines, stack = [], [(self.root_node, 0)]
        while stack:
            node, depth = stack.pop()
            if node is not self.root_node:
                lines.append(
                    f"{'  ' * (depth - 1)}{len(node.key)} {node.key[:10]} "
                    f"r={node.lock_ref} t={node.last_access_time}"
                )
            stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        lines.append(f"#tokens: {self.total_size()}")
        return "\n".join(lines)
