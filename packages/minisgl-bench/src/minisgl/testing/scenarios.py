"""Shared test scenario helpers: deterministic prompts, the KV cleanliness check, and the CPU
decode attention switch."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator


def random_prompts(n: int, lo: int, hi: int, vocab: int = 300, seed: int = 0) -> list[list[int]]:
    """`n` token prompts of length in [lo, hi], ids in [3, vocab), deterministic from `seed`."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_kv_clean(llm) -> None:
    """After a scenario: integrity holds and every page is free or owned by the cache."""
    assert not llm.has_work(), "a scenario ends with no request and no step in flight"
    assert_scheduler_clean(llm.scheduler)


def assert_scheduler_clean(sched) -> None:
    """A drained scheduler backend: integrity holds, no request is left, and every page is
    free or owned by the cache."""
    sched.check_integrity()
    usage = sched.kv_usage()
    assert usage["running"] == 0 and usage["waiting"] == 0, usage
    cached_pages = usage["cached_tokens"] // sched.page_size
    assert usage["free_pages"] + cached_pages == usage["total_pages"], usage


@contextlib.contextmanager
def cpu_attention(mode: str) -> Iterator[None]:
    """CPU decode attention through `mode` for the engines built inside: "native" (the C kernel,
    reading the KV pool in place) or "sdpa" (SDPA over the dense decode workspace)."""
    from minisgl.kernels import cpu as cpu_native

    old = os.environ.get("MINISGL_CPU_ATTENTION")
    os.environ["MINISGL_CPU_ATTENTION"] = mode
    cpu_native._library.cache_clear()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MINISGL_CPU_ATTENTION", None)
        else:
            os.environ["MINISGL_CPU_ATTENTION"] = old
        cpu_native._library.cache_clear()
