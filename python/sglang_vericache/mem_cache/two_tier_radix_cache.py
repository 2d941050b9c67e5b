"""Two-tier radix cache: every node holds exact KV slots and, optionally, compressed chunk ids.

ARCHITECTURE.md section 4. A node's two handles:
  value: exact slots of its key (len(key) of them), in the exact pool (the "host" tier);
  comp:  None, or one compressed chunk id per page of its key (len(key) // page_size of them),
         in the CompressedKVPool (the "device" tier). comp[i] compresses value[i*P:(i+1)*P].

Tree invariants (on top of RadixCache's page alignment):
  E. Every node has exact KV. Exact eviction removes a leaf with both its handles.
  C. Comp is closed towards the root: a node with comp has a parent with comp (or the root).
     So the compressed part of any path is a prefix of it, and `path_comp(node)` is one run of
     chunk ids from position 0. Insert/set_comp attach comp from the root down; evict_compressed
     only drops comp from a node none of whose children has comp (deepest first).
  L. Two lock counters per node, each taken along a whole path root..node:
     lock_ref       pins the node's exact KV (as in RadixCache);
     comp_lock_ref  pins its comp, the comp present now and any attached while locked. A node
                    comp-locked also keeps its exact KV (exact eviction would take comp along).
     evict() skips nodes with either count > 0; evict_compressed() skips comp_lock_ref > 0.
  S. Sizes: evictable_size()/protected_size() count exact tokens of nodes with both counts 0 /
     with either count > 0; comp_evictable_chunks()/comp_protected_chunks() count comp ids of
     nodes with comp_lock_ref == 0 / > 0.

Ownership: ids in the tree are the tree's, freed only by evict()/evict_compressed(). Callers
free the duplicates that insert()/set_comp() return.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sglang_vericache.mem_cache.radix_cache import MatchResult, RadixCache, TreeNode, evict_lru

if TYPE_CHECKING:
    from sglang_vericache.mem_cache.compressed_pool import CompressedKVPool
    from sglang_vericache.mem_cache.memory_pool import PagedTokenAllocator, ReqToTokenPool


class TwoTierTreeNode(TreeNode):
    def __init__(self, access_time: int = 0):
        super().__init__(access_time)
        self.comp: torch.Tensor | None = None  # int64 chunk ids, one per page of key
        self.comp_lock_ref = 0

    def __repr__(self) -> str:
        n_comp = None if self.comp is None else len(self.comp)
        return (
            f"TwoTierTreeNode(id={self.id}, len={len(self.key)}, comp={n_comp}, "
            f"lock_ref={self.lock_ref}, comp_lock_ref={self.comp_lock_ref})"
        )


@dataclass(frozen=True)
class TwoTierMatch(MatchResult):
    """device_indices/last_node as RadixCache; comp_indices: one chunk id per page of the
    longest compressed prefix of the match (from position 0; invariant C)."""

    comp_indices: torch.Tensor
    page_size: int

    @property
    def comp_len(self) -> int:
        """Tokens the compressed prefix covers: len(comp_indices) * page_size <= len(device_indices)."""
        return len(self.comp_indices) * self.page_size


@dataclass(frozen=True)
class InsertResult:
    prefix_len: int  # exact tokens already in the tree: the caller frees its own slots for them
    dup_comp: torch.Tensor  # caller's chunk ids not adopted (the tree has other ids there): free them


class TwoTierRadixCache(RadixCache):
    node_cls = TwoTierTreeNode

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool | None,
        token_to_kv_pool_allocator: PagedTokenAllocator | None,
        compressed_pool: CompressedKVPool | None,
        page_size: int,
        disable: bool = False,
    ):
        if compressed_pool is not None:
            assert compressed_pool.chunk_size == page_size, "a compressed chunk must be exactly one page"
        self.compressed_pool = compressed_pool
        # False (segment scope, TwoTierKV.segment_scope): a request's chunks depend on its whole
        # prompt, so the tree takes exact KV alone and the requests' chunks are freed with them.
        self.share_comp = True
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size, disable)

    # ------------------------------------------------------------------ public API

    def reset(self) -> None:
        super().reset()
        self.root_node.comp_lock_ref = 1  # the root holds nothing and is never evicted
        self.comp_evictable_chunks_ = 0
        self.comp_protected_chunks_ = 0
        self.num_comp_matched_tokens = 0

    def match_prefix(self, key: list[int], record_stats: bool = True) -> TwoTierMatch:
        m = super().match_prefix(key, record_stats)
        comp = self.path_comp(m.last_node)
        if record_stats:
            self.num_comp_matched_tokens += len(comp) * self.page_size
        return TwoTierMatch(m.device_indices, m.last_node, comp, self.page_size)

    def insert(self, key: list[int], value: torch.Tensor, comp: torch.Tensor | None = None) -> InsertResult:
        """Inserts exact `value` for `key` and chunk ids `comp` for its first len(comp) pages.

        Exact: as RadixCache.insert (the tree takes value[prefix_len:]). Comp, page by page: a
        node without comp adopts the caller's ids (splitting where comp ends inside it); where the
        tree has comp, the caller's ids go to dup_comp, except ids equal to the tree's at that
        page (the caller's own matched prefix), which are neither adopted nor returned.
        A disabled cache adopts nothing: dup_comp is all of comp.
        """
        comp = self._as_ids(comp)
        assert len(comp) * self.page_size <= len(key), f"{len(comp)} chunks for {len(key)} tokens"
        prefix_len = super().insert(key, value)
        if self.disable:
            return InsertResult(prefix_len, comp)
        if len(comp) == 0:
            return InsertResult(prefix_len, comp)
        last = self._match(list(key), count_hit=False).last_node  # ends exactly at len(key)
        return InsertResult(prefix_len, self._attach_comp(last, comp))

    def set_comp(self, node: TreeNode, comp: torch.Tensor) -> torch.Tensor:
        """Attaches chunk ids for the first len(comp) pages of the path root..node (e.g. chunks
        rebuilt from exact KV). Same adoption rule as insert; returns the duplicates to free.
        `node` must be in the tree (hold a lock on it)."""
        comp = self._as_ids(comp)
        if self.disable or len(comp) == 0:
            return comp
        return self._attach_comp(node, comp)

    def path_comp(self, node: TreeNode) -> torch.Tensor:
        """Chunk ids of the compressed prefix of the path root..node (invariant C)."""
        parts = []
        for n in self._path(node):
            if n.comp is None:
                break
            parts.append(n.comp)
        return torch.cat(parts) if parts else self._as_ids(None)

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Pins the exact KV of root..node; returns the change of evictable_size()."""
        return self._lock_path(node, 1, 0)[0]

    def dec_lock_ref(self, node: TreeNode) -> int:
        return self._lock_path(node, -1, 0)[0]

    def inc_comp_lock_ref(self, node: TreeNode) -> int:
        """Pins the comp of root..node (also comp attached later); returns the change of
        comp_evictable_chunks(). Also keeps those nodes' exact KV (invariant L)."""
        return self._lock_path(node, 0, 1)[1]

    def dec_comp_lock_ref(self, node: TreeNode) -> int:
        return self._lock_path(node, 0, -1)[1]

    def evict_compressed(self, num_chunks: int) -> int:
        """Compressed tier: drops the comp of LRU unlocked nodes that have no child with comp,
        until >= num_chunks ids are freed; exact KV stays. Returns the count."""
        if self.disable:
            return 0

        def next_leaf(node: TreeNode) -> TreeNode | None:
            parent = node.parent
            if parent.comp is not None and parent.comp_lock_ref == 0 and self._is_comp_leaf(parent):
                return parent
            return None

        leaves = [n for n in self._comp_leaves() if n.comp_lock_ref == 0]
        return evict_lru(leaves, num_chunks, self._drop_comp, next_leaf)

    def comp_evictable_chunks(self) -> int:
        return self.comp_evictable_chunks_

    def comp_protected_chunks(self) -> int:
        return self.comp_protected_chunks_

    def comp_total_chunks(self) -> int:
        return self.comp_evictable_chunks_ + self.comp_protected_chunks_

    def comp_hit_rate(self) -> float:
        """Tokens matched in the compressed tier / tokens queried by match_prefix."""
        return self.num_comp_matched_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    # ------------------------------------------------------------ request hooks
    #
    # Contract with Req (fields beyond the single-tier ones, see RadixCache):
    #   req.comp_indices: int64 chunk ids of the request's first len(comp_indices) pages (page i
    #       = positions [i*P, (i+1)*P)); only whole pages with computed exact KV have one.
    #   req.comp_prefix_len: tokens; the first comp_prefix_len // P of comp_indices are the
    #       tree's (from match_prefix().comp_indices or set_comp), the rest are the request's.
    #   req.last_node is locked in BOTH tiers (inc_lock_ref and inc_comp_lock_ref), and
    #       comp_prefix_len <= len(prefix_indices).

    def cache_finished_req(self, req: Any) -> None:
        """Gives the request's page-aligned committed KV (both tiers) to the tree, frees the rest
        and the duplicates, unlocks both tiers and releases the row."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        comp = self._as_ids(req.comp_indices)
        if self.disable:
            self.token_to_kv_pool_allocator.free(row[: req.kv_allocated_len])
            self.compressed_pool.free(comp)
        else:
            cached_len, n_comp = self._insert_req(req, row)
            self.token_to_kv_pool_allocator.free(row[cached_len : req.kv_allocated_len])
            self.compressed_pool.free(comp[n_comp:])  # chunks past the cached pages
            self.dec_lock_ref(req.last_node)
            self.dec_comp_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req: Any) -> None:
        """Shares the request's page-aligned committed KV (both tiers); the request keeps running
        on the tree's copies: rewrites its row, prefix_indices, comp_indices (same length, the
        tree's ids first), comp_prefix_len and last_node, and moves both locks."""
        if self.disable:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        n_prefix = len(req.prefix_indices)
        cached_len, n_comp = self._insert_req(req, row)
        match = self._match(list(req.fill_ids[:cached_len]), count_hit=False)
        new_indices = match.device_indices
        assert len(new_indices) == cached_len, f"{len(new_indices)=} != {cached_len=}"
        self.req_to_token_pool.write(req.req_pool_idx, n_prefix, new_indices[n_prefix:])
        tree_comp = self.path_comp(match.last_node)
        assert len(tree_comp) >= n_comp, "the request's compressed pages left the tree"
        self.inc_lock_ref(match.last_node)
        self.inc_comp_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        self.dec_comp_lock_ref(req.last_node)
        req.prefix_indices = new_indices
        req.comp_indices = torch.cat([tree_comp[:n_comp], self._as_ids(req.comp_indices)[n_comp:]])
        req.comp_prefix_len = n_comp * self.page_size
        req.last_node = match.last_node

    # ------------------------------------------------------------------ internals

    def _insert_req(self, req: Any, row: torch.Tensor) -> tuple[int, int]:
        """Inserts the committed whole pages of both tiers and frees the request's duplicates.
        Returns (cached tokens, comp pages inserted)."""
        n_prefix = len(req.prefix_indices)
        cached_len = self._page_floor(req.kv_committed_len)
        assert n_prefix <= cached_len, f"{n_prefix=} > {cached_len=}"
        assert req.comp_prefix_len <= n_prefix, f"{req.comp_prefix_len=} > {n_prefix=}"
        comp = self._as_ids(req.comp_indices)
        n_comp = min(len(comp), cached_len // self.page_size) if self.share_comp else 0
        slots = row[:cached_len].clone()
        res = self.insert(list(req.fill_ids[:cached_len]), slots, comp[:n_comp])
        assert res.prefix_len >= n_prefix, "the request's locked prefix left the tree"
        self.token_to_kv_pool_allocator.free(slots[n_prefix : res.prefix_len])
        self.compressed_pool.free(res.dup_comp)
        return cached_len, n_comp

    def _as_ids(self, ids: torch.Tensor | None) -> torch.Tensor:
        if ids is None:
            return torch.empty(0, dtype=torch.int64)
        return ids.to(torch.int64).cpu()

    def _path(self, node: TreeNode) -> list[TreeNode]:
        """Nodes from the root's child down to node (empty for the root)."""
        path = []
        while node is not self.root_node:
            path.append(node)
            node = node.parent
        return path[::-1]

    def _pinned(self, node: TreeNode) -> bool:
        """Exact KV stays while either tier is locked (invariant L)."""
        return node.lock_ref > 0 or node.comp_lock_ref > 0

    def _on_evict(self, node: TreeNode) -> None:
        """evict (exact tier) frees LRU leaves unpinned in both tiers: their comp goes too."""
        self._drop_comp(node)

    def _lock_path(self, node: TreeNode, d_exact: int, d_comp: int) -> tuple[int, int]:
        """Adds to both counters along root..node; returns the changes of (evictable_size,
        comp_evictable_chunks)."""
        if self.disable:
            return 0, 0
        delta_exact = delta_comp = 0
        while node is not self.root_node:
            was_pinned, was_comp_locked = self._pinned(node), node.comp_lock_ref > 0
            node.lock_ref += d_exact
            node.comp_lock_ref += d_comp
            assert node.lock_ref >= 0 and node.comp_lock_ref >= 0, f"unlock of unlocked {node}"
            if self._pinned(node) != was_pinned:
                sign = 1 if was_pinned else -1  # +1: becomes evictable
                self.evictable_size_ += sign * len(node.key)
                self.protected_size_ -= sign * len(node.key)
                delta_exact += sign * len(node.key)
            if node.comp is not None and (node.comp_lock_ref > 0) != was_comp_locked:
                sign = 1 if was_comp_locked else -1
                self.comp_evictable_chunks_ += sign * len(node.comp)
                self.comp_protected_chunks_ -= sign * len(node.comp)
                delta_comp += sign * len(node.comp)
            node = node.parent
        return delta_exact, delta_comp

    def _attach_comp(self, last: TreeNode, comp: torch.Tensor) -> torch.Tensor:
        """comp: ids of the first len(comp) pages of root..last. A node without comp adopts its
        pages' ids (split first if comp ends inside it); returns the caller's ids that differ
        from the tree's where the tree has comp."""
        dups, start = [], 0
        for node in self._path(last):
            if start == len(comp):
                break
            ids = comp[start : start + len(node.key) // self.page_size]
            start += len(ids)
            if node.comp is not None:
                dups.append(ids[ids != node.comp[: len(ids)]])
                continue
            if len(ids) * self.page_size < len(node.key):
                node = self._split_node(node, len(ids) * self.page_size)
            node.comp = ids.clone()
            if node.comp_lock_ref > 0:
                self.comp_protected_chunks_ += len(ids)
            else:
                self.comp_evictable_chunks_ += len(ids)
        assert start == len(comp), f"{len(comp)} chunks for a path of {start} pages"
        return torch.cat(dups) if dups else self._as_ids(None)

    def _drop_comp(self, node: TreeNode) -> int:
        """Frees an unlocked node's comp; returns how many ids."""
        if node.comp is None:
            return 0
        assert node.comp_lock_ref == 0, f"dropping locked comp of {node}"
        n = len(node.comp)
        self.compressed_pool.free(node.comp)
        self.comp_evictable_chunks_ -= n
        node.comp = None
        return n

    def _is_comp_leaf(self, node: TreeNode) -> bool:
        return all(c.comp is None for c in node.children.values())

    def _comp_leaves(self) -> list[TreeNode]:
        out, stack = [], list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            if node.comp is None:
                continue  # invariant C: nothing below has comp
            if self._is_comp_leaf(node):
                out.append(node)
            stack.extend(node.children.values())
        return out

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        comp = child.comp
        new_node = super()._split_node(child, split_len)
        new_node.comp_lock_ref = child.comp_lock_ref  # same lockers: sizes unchanged
        if comp is not None:
            n = split_len // self.page_size
            new_node.comp, child.comp = comp[:n].clone(), comp[n:].clone()
        return new_node

    def _format(self) -> str:
        text = super()._format()
        comp_chunks = self.comp_total_chunks()
        return f"{text}\n#comp chunks: {comp_chunks}"
