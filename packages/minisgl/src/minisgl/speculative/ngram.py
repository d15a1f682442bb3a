"""N-gram (prompt lookup) drafts: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from `max_n` down to `min_n`, the longest match wins), up to k of
them. No weights: a draft is a pure function of the prompt and the output so far."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_N = 3
MIN_N = 1
_EMPTY = np.zeros(0, dtype=np.int32)


def ngram_draft(tokens: np.ndarray, k: int, max_n: int = MAX_N, min_n: int = MIN_N) -> np.ndarray:
    """Up to `k` draft tokens for `tokens` (int32, the prompt then the outputs), empty when no
    suffix of `min_n`..`max_n` tokens occurred earlier with a token after it."""
    size = len(tokens)
    if k <= 0 or size < 2:
        return _EMPTY
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        # a start i with tokens[i : i + n] == suffix and a token after it (i + n < size)
        hits = np.flatnonzero(tokens[: size - n] == suffix[0])
        for j in range(1, n):
            if not len(hits):
                break
            hits = hits[tokens[hits + j] == suffix[j]]
        if len(hits):
            start = int(hits[-1]) + n  # the latest occurrence
            return np.asarray(tokens[start : start + k], dtype=np.int32)
    return _EMPTY


class NgramDraft:
    """The `ngram` draft source."""

    name = "ngram"
    exact = False  # a lookup may find fewer than k tokens; proposing costs nothing

    def propose_many(self, tokens: Sequence[np.ndarray], ks: Sequence[int]) -> list[np.ndarray]:
        return [self.propose(t, k) for t, k in zip(tokens, ks, strict=True)]

    def __init__(self, max_n: int = MAX_N, min_n: int = MIN_N) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, tokens: np.ndarray, k: int) -> np.ndarray:
        return ngram_draft(tokens, k, self.max_n, self.min_n)
