"""Radix cache: split, page-boundary matching, eviction order, locks; property-based model check."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.kvcache import NaiveCache, RadixCache


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


@pytest.mark.card("P0-010", "split-page-boundary-match-lru-eviction-and-locks")
def test_insert_match_and_split():
    c = RadixCache(page_size=1)
    assert c.insert(arr(1, 2, 3, 4), arr(10, 11, 12, 13)) == 0
    m = c.match_prefix(arr(1, 2, 9))
    assert m.indices.tolist() == [10, 11]  # split at 2
    assert c.insert(arr(1, 2, 7), arr(20, 21, 22)) == 2
    assert c.match_prefix(arr(1, 2, 7, 8)).indices.tolist() == [10, 11, 22]
    assert c.match_prefix(arr(1, 2, 3, 4, 5)).indices.tolist() == [10, 11, 12, 13]
    assert c.evictable_size == 5
    c.check_integrity()


@pytest.mark.card("P0-010", "split-page-boundary-match-lru-eviction-and-locks")
def test_match_stops_at_page_boundary():
    c = RadixCache(page_size=4)
    c.insert(arr(*range(8)), arr(*range(100, 108)))
    # 6 matching tokens -> only the first full page counts
    m = c.match_prefix(arr(0, 1, 2, 3, 4, 5, 99, 99))
    assert m.length == 4 and m.indices.tolist() == [100, 101, 102, 103]
    assert c.match_prefix(arr(0, 1, 2)).length == 0  # shorter than a page
    with pytest.raises(ValueError):
        c.insert(arr(1, 2, 3), arr(1, 2, 3))  # not page aligned
    c.check_integrity()


@pytest.mark.card("P0-010", "split-page-boundary-match-lru-eviction-and-locks")
def test_eviction_is_lru_over_leaves_and_skips_locked():
    c = RadixCache(page_size=1)
    c.insert(arr(1, 1), arr(0, 1))  # oldest
    c.insert(arr(2, 2), arr(2, 3))
    c.insert(arr(3, 3), arr(4, 5))
    locked = c.match_prefix(arr(1, 1))  # touches [1,1]: now newest
    c.lock(locked.node)
    assert c.protected_size == 2 and c.evictable_size == 4
    assert c.evict(2).tolist() == [2, 3]  # [2,2] is the LRU unlocked leaf
    assert c.evict(10).tolist() == [4, 5]  # [1,1] is locked: never evicted
    assert c.match_prefix(arr(1, 1)).length == 2
    c.unlock(locked.node)
    assert c.evict(1).tolist() == [0, 1]
    assert c.evictable_size == 0
    c.check_integrity()


@pytest.mark.card("P0-010", "split-page-boundary-match-lru-eviction-and-locks")
def test_parent_becomes_evictable_after_children():
    c = RadixCache(page_size=1)
    c.insert(arr(1, 2, 3), arr(0, 1, 2))
    c.insert(arr(1, 2, 4), arr(5, 6, 7))  # splits: [1,2] -> {[3], [4]}
    freed = c.evict(3)
    assert sorted(freed.tolist()) == [0, 1, 2, 7]
    assert c.evictable_size == 0 and c.match_prefix(arr(1, 2)).length == 0


@pytest.mark.card("P0-010", "split-page-boundary-match-lru-eviction-and-locks")
def test_unlock_unlocked_raises():
    c = RadixCache(page_size=1)
    c.insert(arr(1), arr(0))
    node = c.match_prefix(arr(1)).node
    with pytest.raises(RuntimeError):
        c.unlock(node)


def test_naive_cache_never_shares():
    c = NaiveCache(page_size=1)
    assert c.insert(arr(1, 2), arr(0, 1)) == 2
    assert c.match_prefix(arr(1, 2)).length == 0 and c.evict(5).size == 0


# ---------------------------------------------------------------- property based
class ModelCache:
    """The simplest correct model: a list of (tokens, locations) entries that never overlap."""

    def __init__(self, ps: int) -> None:
        self.ps = ps
        self.store: dict[tuple[int, ...], int] = {}  # page-aligned prefix -> location of last page

    def match_len(self, tokens: list[int]) -> int:
        n = 0
        while n + self.ps <= len(tokens) and tuple(tokens[: n + self.ps]) in self.store:
            n += self.ps
        return n


ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match", "lock", "unlock", "evict"]),
        st.lists(st.integers(0, 3), min_size=0, max_size=12),
        st.integers(0, 16),
    ),
    max_size=40,
)


@pytest.mark.card("P0-010", "random-operation-sequences-agree-with-a-model")
@settings(max_examples=150, deadline=None)
@given(ps=st.sampled_from([1, 2, 4]), seq=ops)
def test_random_operations_match_model(ps, seq):
    cache, model = RadixCache(ps), ModelCache(ps)
    next_loc, owned, locks = 0, {}, []  # owned: location -> prefix it caches
    for op, raw, k in seq:
        tokens = raw[: len(raw) // ps * ps]
        if op == "insert":
            n = len(tokens)
            locs = np.arange(next_loc, next_loc + n, dtype=np.int32)
            next_loc += n
            present = cache.insert(np.array(tokens, dtype=np.int32), locs)
            assert present == model.match_len(tokens)
            for i in range(present, n, ps):
                model.store[tuple(tokens[: i + ps])] = int(locs[i])
                for j in range(ps):
                    owned[int(locs[i + j])] = tuple(tokens[: i + ps])
        elif op == "match":
            m = cache.match_prefix(np.array(raw, dtype=np.int32))
            assert m.length == model.match_len(raw)
            for i in range(0, m.length, ps):  # each page maps to the KV that cached it
                assert owned[int(m.indices[i])] == tuple(raw[: i + ps])
        elif op == "lock":
            m = cache.match_prefix(np.array(raw, dtype=np.int32))
            cache.lock(m.node)
            locks.append((m.node, tuple(raw[: m.length])))
        elif op == "unlock" and locks:
            node, _ = locks.pop(k % len(locks))
            cache.unlock(node)
        elif op == "evict":
            before = cache.evictable_size
            freed = cache.evict(k)
            assert len(freed) >= min(k, before) or cache.evictable_size == 0
            assert len(freed) % ps == 0
            for loc in freed.tolist():
                model.store.pop(owned.pop(loc), None)
        cache.check_integrity()
        for _, prefix in locks:  # locked prefixes are never evicted
            assert cache.match_prefix(np.array(prefix, dtype=np.int32)).length == len(prefix)
        assert cache.evictable_size + cache.protected_size == len(cache.all_indices())
