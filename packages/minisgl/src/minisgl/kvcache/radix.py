"""Radix prefix cache over token ids (the Python reference the Rust port must match exactly).

Semantics (documented here once; `rust/minisgl-cpu-core` mirrors them):
- Every key and value is page aligned. A child is addressed by its first page of tokens.
- A logical clock advances by one per `match_prefix` / `insert`; every node on the visited
  path gets `last_access = clock`.
- `match_prefix` splits a node when the match ends inside it (at a page boundary), so the
  returned node ends exactly at the matched length. The new prefix node takes the next id;
  the old node keeps its id and becomes the suffix child.
- `insert` walks like `match_prefix` (splitting the same way), then adds the unmatched tail
  as one new leaf and returns the length that was already present.
- `lock` / `unlock` add / remove one reference on every node from the handle to the root.
- `evict` removes unlocked leaves in order of (last_access, node id), a parent becoming an
  unlocked leaf joins the candidates, until at least the requested tokens are freed.
- The scheduler caches unfinished requests: after each prefill chunk it calls
  `insert(prefix)` then `match_prefix(prefix)` (two clock ticks, in that order), locks the
  returned node and only then unlocks the request's previous node (see
  `Scheduler._cache_prefix`); a finished request is inserted once more on release.
"""

from __future__ import annotations

import heapq

import numpy as np

from minisgl.kvcache.base import MatchResult

_EMPTY = np.zeros(0, dtype=np.int32)


class RadixNode:
    __slots__ = ("children", "id", "key", "last_access", "parent", "ref", "value")

    def __init__(self, node_id: int, key: np.ndarray, value: np.ndarray, parent: RadixNode | None):
        self.id = node_id
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.ref = 0
        self.last_access = 0


class RadixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._next_id = 1
        self._clock = 0
        self.root = RadixNode(0, _EMPTY, _EMPTY, None)
        self.root.ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    # ---------------------------------------------------------------- queries
    def match_prefix(self, tokens: np.ndarray) -> MatchResult:
        tokens = self._aligned(tokens)
        self._clock += 1
        node, _, parts = self._walk(tokens)
        value = np.concatenate(parts) if parts else _EMPTY
        return MatchResult(node, value)

    def insert(self, tokens: np.ndarray, indices: np.ndarray) -> int:
        tokens = np.asarray(tokens, dtype=np.int32)
        indices = np.asarray(indices, dtype=np.int32)
        if len(tokens) != len(indices) or len(tokens) % self.page_size:
            raise ValueError("insert needs equal, page-aligned tokens and indices")
        self._clock += 1
        node, pos, _ = self._walk(tokens)
        if pos < len(tokens):
            leaf = self._new_node(tokens[pos:].copy(), indices[pos:].copy(), node)
            leaf.last_access = self._clock
            node.children[self._page_key(leaf.key)] = leaf
            self._evictable += len(leaf.key)
        return pos

    # ---------------------------------------------------------------- locking
    def lock(self, node: RadixNode | None) -> None:
        while node is not None and node is not self.root:
            if node.ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.ref += 1
            node = node.parent

    def unlock(self, node: RadixNode | None) -> None:
        while node is not None and node is not self.root:
            if node.ref <= 0:
                raise RuntimeError(f"unlock of unlocked radix node {node.id}")
            node.ref -= 1
            if node.ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent

    # ---------------------------------------------------------------- eviction
    def evict(self, num_tokens: int) -> np.ndarray:
        if num_tokens <= 0:
            return _EMPTY
        heap = [(n.last_access, n.id, n) for n in self._nodes() if not n.children and n.ref == 0]
        heapq.heapify(heap)
        freed: list[np.ndarray] = []
        total = 0
        while total < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._page_key(leaf.key)]
            freed.append(leaf.value)
            total += len(leaf.value)
            self._evictable -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return np.concatenate(freed) if freed else _EMPTY

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    def all_indices(self) -> np.ndarray:
        parts = [n.value for n in self._nodes()]
        return np.concatenate(parts) if parts else _EMPTY

    def check_integrity(self) -> None:
        evictable = protected = 0
        for node in self._nodes():
            ps = self.page_size
            if len(node.key) == 0 or len(node.key) % ps or len(node.key) != len(node.value):
                raise AssertionError(f"radix node {node.id}: bad key/value lengths")
            parent = node.parent
            assert parent is not None
            if parent.children.get(self._page_key(node.key)) is not node:
                raise AssertionError(f"radix node {node.id}: not linked from its parent")
            if node.ref < 0 or (parent is not self.root and parent.ref < node.ref):
                raise AssertionError(f"radix node {node.id}: bad lock count {node.ref}")
            if node.ref == 0:
                evictable += len(node.key)
            else:
                protected += len(node.key)
        if (evictable, protected) != (self._evictable, self._protected):
            raise AssertionError(
                f"radix size accounting: counted {(evictable, protected)}, "
                f"tracked {(self._evictable, self._protected)}"
            )
        idx = self.all_indices()
        if len(np.unique(idx)) != len(idx):
            raise AssertionError("radix cache holds a KV location twice")

    # ---------------------------------------------------------------- internals
    def _aligned(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int32)
        return tokens[: len(tokens) // self.page_size * self.page_size]

    def _page_key(self, tokens: np.ndarray) -> bytes:
        return tokens[: self.page_size].tobytes()

    def _walk(self, tokens: np.ndarray) -> tuple[RadixNode, int, list[np.ndarray]]:
        """Follow `tokens` from the root, splitting at a partial match; touch visited nodes."""
        node, pos, parts = self.root, 0, []
        n = len(tokens)
        while pos < n:
            child = node.children.get(self._page_key(tokens[pos:]))
            if child is None:
                break
            common = self._common_len(child.key, tokens[pos:])
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = self._clock
            parts.append(child.value)
            pos += common
            node = child
        return node, pos, parts

    def _common_len(self, key: np.ndarray, tokens: np.ndarray) -> int:
        m = min(len(key), len(tokens))
        diff = np.flatnonzero(key[:m] != tokens[:m])
        common = int(diff[0]) if len(diff) else m
        return common // self.page_size * self.page_size

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        parent = child.parent
        assert parent is not None
        mid = self._new_node(child.key[:at], child.value[:at], parent)
        mid.ref = child.ref
        mid.last_access = child.last_access
        child.key = child.key[at:]
        child.value = child.value[at:]
        child.parent = mid
        mid.children[self._page_key(child.key)] = child
        parent.children[self._page_key(mid.key)] = mid
        return mid

    def _new_node(self, key: np.ndarray, value: np.ndarray, parent: RadixNode) -> RadixNode:
        node = RadixNode(self._next_id, key, value, parent)
        self._next_id += 1
        return node

    def _nodes(self) -> list[RadixNode]:
        out: list[RadixNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
