"""Balanced prefill steps (card P2-003): a prefill step that spends its whole token budget while
fewer than a budget's worth of prompt tokens are left for the next step is cut so the two
steps are even (not a full step and a small tail), on both scheduler backends, with the same
tokens as HF and every KV page back."""

from __future__ import annotations

import json

import pytest

from minisgl import LLM, SamplingParams
from minisgl.benchmark import replay as rp
from minisgl.scheduler.backend import SchedulerBackend, SchedulerConfig
from minisgl.scheduler.factory import make_scheduler
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.scenarios import assert_kv_clean, assert_scheduler_clean, random_prompts
from minisgl.testing.tiny_models import write_tiny_model

CARD = "P2-003"
ITEM = "a-prefill-that-needs-one-more-step-splits-its-tokens-evenly-between-the-two"
RED = "failing-tests-balanced-prefill-steps"
BUDGET = 16


def _backends() -> list:
    return ["python", pytest.param("rust_hotpath", marks=pytest.mark.rust_ext)]


def _config(max_running: int = 4, page_size: int = 4) -> SchedulerConfig:
    return SchedulerConfig(num_pages=256 // page_size, page_size=page_size, max_seq_len=96,
                           max_running_requests=max_running, max_extend_tokens=BUDGET,
                           cache_type="radix", eos_token_ids=())  # fmt: skip


def _prefill_steps(s: SchedulerBackend, prompt_lens: list[int]) -> list[list[int]]:
    """Drive `s` to the end (one new token each, prompts of distinct tokens): the extend
    lengths of each prefill step, in batch order."""
    for i, n in enumerate(prompt_lens):
        s.add_request([100 * (i + 1) + t for t in range(n)], SamplingParams(max_tokens=1))
    steps = []
    while s.has_work():
        step = s.schedule()
        assert step is not None
        if step.plan.is_prefill:
            steps.append(step.plan.extend_lens.tolist())
        s.commit(step.reqs, step.plan, [7] * len(step.plan.sample_rows))
    assert_scheduler_clean(s)
    return steps


@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, ITEM)
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize(
    "prompt_lens,expected",
    [
        # 20 tokens: 10 + 10, not 16 + 4; the second request is admitted in the first step
        # with no tokens and continues first in the second
        ([12, 8], [[10], [2, 8]]),
        # 40 tokens: a full step while more than a budget is left, then 12 + 12
        ([30, 10], [[16], [12], [2, 10]]),
        # the budget spent and nothing left: one full step
        ([8, 8], [[8, 8]]),
        # a single long prompt: 24 tokens in two even steps
        ([24], [[12], [12]]),
        # the budget not spent: nothing is cut
        ([5, 6], [[5, 6]]),
    ],
)
def test_the_last_two_prefill_steps_are_even(backend, prompt_lens, expected):
    assert _prefill_steps(make_scheduler(_config(), backend, shadow=False), prompt_lens) == expected


@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, ITEM)
@pytest.mark.parametrize("backend", _backends())
def test_waiting_requests_beyond_the_free_slots_do_not_count(backend):
    """One slot: the second prompt cannot join the next step, so only the first prompt's rest
    (4 tokens) is left for it: 10 + 10; the second prompt then runs alone."""
    s = make_scheduler(_config(max_running=1), backend, shadow=False)
    assert _prefill_steps(s, [20, 8]) == [[10], [10], [8]]


@pytest.mark.card(CARD, ITEM)
@pytest.mark.rust_ext
def test_backends_cut_the_same_steps():
    """A mixed queue (23 prompts of 3-39 tokens, 473 in all, 4 slots): the Rust core cuts
    exactly where the Python scheduler does: full steps, then 13 + 12 tokens, not 16 + 9."""
    lens = [int(n) for n in random_prompts(1, 24, 24, vocab=40, seed=5)[0]][:-1]
    expected = _prefill_steps(make_scheduler(_config(), "python", shadow=False), lens)
    assert _prefill_steps(make_scheduler(_config(), "rust_hotpath", shadow=False), lens) == expected
    totals = [sum(step) for step in expected]
    assert sum(lens) == 473 and totals == [BUDGET] * 28 + [13, 12], totals


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = write_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-balance"), seed=0)
    return path, load_hf_model(path)


@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, ITEM)
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("page_size", [1, 4])
def test_balanced_steps_generate_what_hf_does(tiny_llama, backend, page_size, monkeypatch):
    """fp32 greedy through cut steps (a request admitted with no tokens, chunks ending off a
    page) equals HF; the engine ran the even split."""
    path, hf = tiny_llama
    monkeypatch.setenv("MINISGL_CPU_BACKEND", backend)
    prompts = random_prompts(5, 9, 15, seed=21)  # 59 tokens: 30 + 29, not 48 + 11
    ref = hf_greedy(hf, prompts, 6)
    llm = LLM(path, page_size=page_size, num_pages=1024 // page_size, max_extend_tokens=48)
    steps: list[int] = []
    forward = llm.engine._forward

    def recording_forward(plan, *args):
        if plan.is_prefill:
            steps.append(int(plan.extend_lens.sum()))
        return forward(plan, *args)

    monkeypatch.setattr(llm.engine, "_forward", recording_forward)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompts, params)
    assert [o["token_ids"] for o in out] == ref
    total = sum(len(p) for p in prompts)
    assert len(steps) == 2 and abs(steps[0] - steps[1]) <= 1 and sum(steps) == total, steps
    assert_kv_clean(llm)


@pytest.mark.card(CARD, ITEM)
@pytest.mark.parametrize("backend", ["python", "rust_service"])
def test_workload_replay_reports_requests_admitted_past_the_cut(tmp_path, backend):
    """Replay (`minisgl.benchmark.replay`) names a request admitted in a step that gives it no
    tokens as admitted in that tick (the Rust replay indexed the batch for it and panicked)."""
    w = {"name": "cut", "capacity": {"num_pages": 64, "page_size": 4, "prefill_budget": 16,
                                     "max_running": 4, "cache": "radix"},
         "requests": [{"id": "a", "output_len": 2, "arrival_tick": 0, "prompt_len": 12},
                      {"id": "b", "output_len": 2, "arrival_tick": 0, "prompt_len": 8}]}  # fmt: skip
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(w))
    report = rp.run_replay(path, backend)
    other = rp.run_replay(path, "rust_service" if backend == "python" else "python")
    ticks = report["ticks"]
    assert [(t["admitted"], t["prefill_tokens"]) for t in ticks[:2]] == [(["a", "b"], 10), ([], 10)]
    assert rp.comparable(report) == rp.comparable(other)
