"""Priority scheduling (`priority_aging_steps`): lower number first, FIFO within a priority,
aging bounds how long the lowest priority waits; off, priorities change nothing. The Python
`Scheduler` and the Rust core (through `minisgl-cpu-service replay`) decide the same."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from minisgl.benchmark import replay as rp
from minisgl.core import SamplingParams
from minisgl.scheduler.scheduler import Scheduler

P = SamplingParams(max_tokens=2, ignore_eos=True)


def _sched(aging: int | None, max_running: int = 1) -> Scheduler:
    return Scheduler(num_pages=64, page_size=4, max_seq_len=64, max_running_requests=max_running,
                     max_extend_tokens=64, cache_type="radix",
                     priority_aging_steps=aging)  # fmt: skip


def _drain_order(s: Scheduler) -> list[int]:
    order: list[int] = []
    n_waiting = len(s.waiting)
    while (step := s.schedule()) is not None:
        n = n_waiting - len(s.waiting)
        order += [r.rid for r in step.reqs[len(step.reqs) - n :]]
        s.commit(step.reqs, step.plan, [7] * len(step.plan.sample_rows))
        n_waiting = len(s.waiting)
    return order


@pytest.mark.parametrize("aging", [None, 4])
def test_lower_number_first_and_fifo_within_a_priority(aging):
    s = _sched(aging)
    prios = [3, 0, 3, -1, 0, 3, -1]
    for rid, p in enumerate(prios):
        s.add_request([1 + rid, 2, 3], P, rid=rid, priority=p)
    if aging is None:  # off: the queue is FIFO whatever the priorities
        assert [r.rid for r in s.waiting] == list(range(7))
        assert _drain_order(s) == list(range(7))
    else:
        assert [r.rid for r in s.waiting] == [3, 6, 1, 4, 0, 2, 5]
        assert _drain_order(s) == [3, 6, 1, 4, 0, 2, 5]
    s.check_integrity()


def test_priority_aging_steps_is_validated():
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="priority_aging_steps"):
            _sched(bad)


def test_a_request_gains_one_level_every_k_steps():
    """After K steps, a waiting priority-1 request ranks with priority 0 arrivals (and ahead
    of them: it came first); before that, a priority-0 arrival overtakes it."""
    k = 3
    s = _sched(k)
    s.add_request([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), rid=0)  # runs
    s.add_request([4, 5, 6], P, rid=1, priority=1)
    for _ in range(k - 1):
        step = s.schedule()
        s.commit(step.reqs, step.plan, [7] * len(step.plan.sample_rows))
    s.add_request([7, 8, 9], P, rid=2, priority=0)  # clock k-1: key k-1 < key(1) = k
    step = s.schedule()
    s.commit(step.reqs, step.plan, [7] * len(step.plan.sample_rows))
    s.add_request([10, 11, 12], P, rid=3, priority=0)  # clock k: key k == key(1): after it
    assert [r.rid for r in s.waiting] == [2, 1, 3]


def _stream(aging: int, n_high: int = 60) -> dict[str, Any]:
    """One slot; a blocker and a priority-4 request at tick 0, then a priority-0 request
    every tick: the queue never empties of higher-priority work."""
    reqs = [
        {"id": "blocker", "prompt_len": 4, "output_len": 2},
        {"id": "low", "prompt_len": 4, "output_len": 2, "priority": 4},
    ]
    reqs += [{"id": f"h{t:03d}", "prompt_len": 4, "output_len": 2, "priority": 0,
              "arrival_tick": t} for t in range(n_high)]  # fmt: skip
    return {"capacity": {"num_pages": 32, "page_size": 4, "prefill_budget": 64,
                         "max_running": 1, "priority_aging_steps": aging}, "requests": reqs}  # fmt: skip


@pytest.mark.parametrize("backend", rp.BACKENDS)
def test_aging_bounds_the_wait_of_the_lowest_priority(tmp_path, backend):
    """The documented bound: a request of priority p is never overtaken by a request of
    priority q arriving (p - q) * K or more steps after it. Here every tick runs one step,
    so steps are ticks: `low` (p=4, K=5) is admitted before every h arriving at tick >= 20,
    i.e. after at most the ~20 earlier ones; without aging (K huge) it starves until the
    stream ends."""
    k, p, q = 5, 4, 0
    path = tmp_path / "stream.json"
    path.write_text(json.dumps(_stream(k)))
    r = rp.run_replay(path, backend, enable_priority=True)
    by_id = {o["id"]: o for o in r["requests"]}
    low = by_id["low"]["admitted_tick"]
    before = [o for o in r["requests"] if o["id"].startswith("h") and o["admitted_tick"] < low]
    assert before and all(o["arrival_tick"] < (p - q) * k for o in before)
    assert low <= 2 * ((p - q) * k + 1) + 2  # each request holds the slot for 2 ticks
    # FIFO within priority 0: admission order is arrival order
    hs = sorted((o for o in r["requests"] if o["id"].startswith("h")),
                key=lambda o: o["admitted_tick"])  # fmt: skip
    assert [o["id"] for o in hs] == sorted(o["id"] for o in hs)
    assert r["pages_returned"]

    path.write_text(json.dumps(_stream(1 << 20)))
    starved = rp.run_replay(path, backend, enable_priority=True)
    last = max(o["admitted_tick"] for o in starved["requests"] if o["id"] != "low")
    assert {o["id"]: o for o in starved["requests"]}["low"]["admitted_tick"] > last
    fifo = rp.run_replay(path, backend, enable_priority=False)
    assert {o["id"]: o for o in fifo["requests"]}["low"]["admitted_tick"] == 2


def test_priorities_change_nothing_when_off(tmp_path):
    """Without --enable-priority the priority fixture replays exactly like the same
    workload with every priority removed (today's FIFO scheduler)."""
    w = json.loads(rp.fixtures()["priority"].read_text())
    for r in w["requests"]:
        r.pop("priority", None)
    path = Path(tmp_path / "nopriority.json")
    path.write_text(json.dumps(w))
    expected = rp.expected_fingerprints()["priority"]
    for backend in rp.BACKENDS:
        assert rp.run_replay(path, backend)["fingerprint"] == expected["fifo"]
        assert (
            rp.run_replay(path, backend, enable_priority=True)["fingerprint"] == (expected["fifo"])
        )


def test_priority_fixture_admits_high_priority_first():
    r = rp.run_replay(rp.fixtures()["priority"], enable_priority=True)
    f = rp.run_replay(rp.fixtures()["priority"])
    wait = {o["id"]: o["admitted_tick"] - o["arrival_tick"] for o in r["requests"]}
    fifo_wait = {o["id"]: o["admitted_tick"] - o["arrival_tick"] for o in f["requests"]}
    prio = {o["id"]: o["priority"] for o in r["requests"]}
    top = [i for i, p in prio.items() if p == min(prio.values())]
    assert all(wait[i] < fifo_wait[i] for i in top)
    assert sum(wait[i] for i in top) < sum(fifo_wait[i] for i in top)
