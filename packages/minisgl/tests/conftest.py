from __future__ import annotations

import random
from pathlib import Path

import pytest

from minisgl.testing.tiny_models import ARCHITECTURES, write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> callable:
    """tiny_model_dir("llama") -> path of a tiny random llama (written once per session)."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = write_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), seed=0)
        return made[arch]

    return get


@pytest.fixture(params=ARCHITECTURES)
def arch(request) -> str:
    return request.param


def random_prompts(n: int, lo: int, hi: int, vocab: int = 300, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_kv_clean(llm) -> None:
    """After a scenario: integrity holds and every page is free or owned by the cache."""
    sched = llm.scheduler
    sched.check_integrity()
    usage = sched.kv_usage()
    assert usage["running"] == 0 and usage["waiting"] == 0
    cached_pages = usage["cached_tokens"] // sched.page_size
    assert usage["free_pages"] + cached_pages == usage["total_pages"], usage
