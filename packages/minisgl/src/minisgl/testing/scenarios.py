"""Shared test scenario helpers: deterministic prompts and the KV cleanliness check."""

from __future__ import annotations

import random


def random_prompts(n: int, lo: int, hi: int, vocab: int = 300, seed: int = 0) -> list[list[int]]:
    """`n` token prompts of length in [lo, hi], ids in [3, vocab), deterministic from `seed`."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_kv_clean(llm) -> None:
    """After a scenario: integrity holds and every page is free or owned by the cache."""
    sched = llm.scheduler
    assert not llm.has_work(), "a scenario ends with no request and no step in flight"
    sched.check_integrity()
    usage = sched.kv_usage()
    assert usage["running"] == 0 and usage["waiting"] == 0, usage
    cached_pages = usage["cached_tokens"] // sched.page_size
    assert usage["free_pages"] + cached_pages == usage["total_pages"], usage
