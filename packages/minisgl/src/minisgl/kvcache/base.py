"""The prefix-cache interface shared by the radix and naive caches (and the Rust port).

All lengths are in tokens and page aligned: a cache only ever holds whole pages. KV locations
are token-level slot indices into the KV pool (`page * page_size + offset`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class MatchResult:
    node: Any  # opaque handle: pass it back to lock()/unlock()
    indices: np.ndarray  # int32 KV locations of the matched prefix, len = matched tokens

    @property
    def length(self) -> int:
        return int(self.indices.shape[0])


class PrefixCache(Protocol):
    page_size: int

    def match_prefix(self, tokens: np.ndarray) -> MatchResult: ...

    def lock(self, node: Any) -> None: ...

    def unlock(self, node: Any) -> None: ...

    def insert(self, tokens: np.ndarray, indices: np.ndarray) -> int:
        """Insert a page-aligned sequence; returns how many leading tokens were already cached.

        The caller still owns `indices[:returned]` (duplicates of cached KV) and must free them;
        the cache takes ownership of `indices[returned:]`.
        """
        ...

    def evict(self, num_tokens: int) -> np.ndarray:
        """Evict at least `num_tokens` (rounded up to pages) of unlocked KV, LRU leaves first.

        Returns the freed locations (possibly fewer when not enough is evictable).
        """
        ...

    @property
    def evictable_size(self) -> int: ...

    @property
    def protected_size(self) -> int: ...

    def all_indices(self) -> np.ndarray:
        """Every KV location the cache owns (for the integrity check)."""
        ...

    def check_integrity(self) -> None: ...
