"""KV memory: paged KV tensors, page allocation, and the prefix caches (radix / naive)."""

from __future__ import annotations

from minisgl.kvcache.base import MatchResult, PrefixCache
from minisgl.kvcache.naive import NaiveCache
from minisgl.kvcache.radix import RadixCache

__all__ = ["MatchResult", "NaiveCache", "PrefixCache", "RadixCache", "create_prefix_cache"]


def create_prefix_cache(cache_type: str, page_size: int) -> PrefixCache:
    if cache_type == "radix":
        return RadixCache(page_size)
    if cache_type == "naive":
        return NaiveCache(page_size)
    raise ValueError(f"unknown cache_type {cache_type!r} (expected 'radix' or 'naive')")
