"""In-batch prefix check (SGLang's): a waiting request whose uncached prompt shares at least
`in_batch_prefix_min` tokens with a request of the prefill step being built waits for the next
step, where that prefix is cached (a prefill step caches its prompts when it is scheduled), so
the shared prefix is computed once, not once per request of a burst. Both scheduler backends
make the same decisions (`test_rust_equivalence.py` draws the threshold too)."""

from __future__ import annotations

import pytest

from minisgl.core import SamplingParams
from minisgl.scheduler.backend import IN_BATCH_PREFIX_MIN, SchedulerConfig
from minisgl.scheduler.factory import make_scheduler

BACKENDS = ["python", pytest.param("rust_hotpath", marks=pytest.mark.rust_ext)]
SHARED = list(range(10, 58))  # 48 tokens


def config(min_shared: int, page_size: int = 1) -> SchedulerConfig:
    return SchedulerConfig(num_pages=1024 // page_size, page_size=page_size, max_seq_len=128,
                           max_running_requests=8, max_extend_tokens=512,
                           eos_token_ids=(0,), in_batch_prefix_min=min_shared)  # fmt: skip


def run(backend: str, cfg: SchedulerConfig, prompts: list[list[int]]) -> tuple[list, int, int]:
    """The requests each step admitted (steps that admitted none left out), the prompt and
    the cached prompt tokens."""
    s = make_scheduler(cfg, backend, shadow=False)
    for p in prompts:
        s.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True))
    steps, seen = [], set()
    while s.has_work():
        step = s.schedule()
        assert step is not None
        new = sorted(r.rid for r in step.reqs if r.rid not in seen)
        seen.update(new)
        if new:
            steps.append(new)
        s.commit(step.reqs, step.plan, [7] * len(step.plan.sample_rows))
    s.check_integrity()
    return steps, s.stats.prompt_tokens, s.stats.cached_prompt_tokens


def test_the_default_is_sglangs_threshold():
    assert IN_BATCH_PREFIX_MIN == 32
    assert SchedulerConfig(num_pages=8, page_size=1, max_seq_len=8, max_running_requests=1,
                           max_extend_tokens=8).in_batch_prefix_min == 32  # fmt: skip
    with pytest.raises(ValueError, match="in_batch_prefix_min"):
        config(-1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_burst_sharing_a_prefix_computes_it_once(backend):
    prompts = [[*SHARED, 100 + i, 101 + i, 102 + i] for i in range(4)] + [[200, 201, 202, 203]]
    steps, prompt, cached = run(backend, config(32), prompts)
    assert steps[0] == [0], steps  # the others wait: request 4 is behind them (FIFO)
    assert steps[1] == [1, 2, 3, 4], steps  # the prefix is cached now
    assert cached == 3 * len(SHARED), (cached, prompt)
    off_steps, _, off_cached = run(backend, config(0), prompts)
    assert off_steps[0] == [0, 1, 2, 3, 4] and off_cached == 0  # 0: no check


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 4])
def test_short_shares_and_distinct_prompts_are_admitted_together(backend, page_size):
    short = SHARED[:20]
    prompts = [short + [100 + i] * 8 for i in range(3)] + [[150 + i] * 12 for i in range(3)]
    steps, _, cached = run(backend, config(32, page_size), prompts)
    assert steps[0] == list(range(6)), steps  # a 20-token share is below the threshold
    assert cached == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cached_prefix_does_not_count_only_what_is_left(backend):
    """Sharing counts the tokens past the waiting request's own cache hit: two requests whose
    48 shared tokens are cached already go together; a longer uncached share still waits."""
    warm = [[*SHARED, 90]]
    cold = [SHARED + list(range(60, 100)) + [100 + i] for i in range(2)]  # 40 more shared
    prompts = [*warm, [*SHARED, 91], [*SHARED, 92], *cold]
    steps, _, cached = run(backend, config(32), prompts)
    assert steps[0] == [0], steps  # 1, 2 share 48 uncached tokens with 0
    assert steps[1] == [1, 2, 3], steps  # 4 shares 40 uncached tokens with 3
    assert steps[2] == [4], steps
    assert cached == 2 * 48 + 48 + 88
