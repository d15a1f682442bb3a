from __future__ import annotations

from typing import Any

import numpy as np

from minisgl.kvcache.base import MatchResult

_EMPTY = np.zeros(0, dtype=np.int32)


class NaiveCache:
    """No prefix sharing: nothing is ever matched, everything inserted is handed back."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    def match_prefix(self, tokens: np.ndarray) -> MatchResult:
        return MatchResult(None, _EMPTY)

    def lock(self, node: Any) -> None:
        pass

    def unlock(self, node: Any) -> None:
        pass

    def insert(self, tokens: np.ndarray, indices: np.ndarray) -> int:
        return len(tokens)  # "already cached": the caller keeps and frees all of it

    def evict(self, num_tokens: int) -> np.ndarray:
        return _EMPTY

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def protected_size(self) -> int:
        return 0

    def all_indices(self) -> np.ndarray:
        return _EMPTY

    def check_integrity(self) -> None:
        pass
