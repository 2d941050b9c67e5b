"""Whole-tree invariant checks of the two-tier radix cache (tests and debugging; O(tree))."""

from __future__ import annotations

from sglang_vericache.mem_cache.two_tier_radix_cache import TwoTierRadixCache


def check_invariants(cache: TwoTierRadixCache) -> None:
    """Asserts invariants E, C, L (path locking) and S over the whole tree. O(tree): for tests
    and debugging."""
    sizes, stack = [0, 0, 0, 0], list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        parent = node.parent
        assert len(node.key) % cache.page_size == 0 and len(node.value) == len(node.key) > 0, node
        if parent is not cache.root_node:  # locks are taken on whole paths
            assert parent.lock_ref >= node.lock_ref and parent.comp_lock_ref >= node.comp_lock_ref, node
        sizes[cache._pinned(node)] += len(node.key)
        if node.comp is not None:
            assert len(node.comp) == len(node.key) // cache.page_size, node
            assert parent is cache.root_node or parent.comp is not None, f"comp below no comp: {node}"
            sizes[2 + (node.comp_lock_ref > 0)] += len(node.comp)
        stack.extend(node.children.values())
    assert tuple(sizes) == (
        cache.evictable_size_, cache.protected_size_, cache.comp_evictable_chunks_, cache.comp_protected_chunks_
    ), f"sizes {sizes}"
