"""The pipelined scheduling mode (`schedule_ahead` / `commit_oldest` / `retire`, up to two steps
in flight): the Rust core (`minisgl_cpu.SchedulerCore`) against the Python reference
(`Scheduler`) decision for decision, deferred release of requests that finish or are retired
mid-flight, pipelined vs serial outputs, and the golden trace replay."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import deque
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minisgl.core import SamplingParams
from minisgl.scheduler.replay import main as replay_main
from minisgl.scheduler.replay import replay_trace
from minisgl.scheduler.request import DROPPED, FINISH_REASONS, RequestError, validate_request
from minisgl.scheduler.scheduler import Scheduler
from minisgl.step.plan import FlatStep, PlanLayout
from minisgl.testing.rust_hotpath import extension

pytestmark = pytest.mark.card(
    "P1-011", "one-step-in-flight-ahead-pages-freed-only-after-confirmation"
)

SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
EOS, STOP = 0, 5


@dataclass(frozen=True)
class Cfg:
    num_pages: int
    page_size: int
    max_seq_len: int
    max_running: int
    max_extend: int
    radix: bool
    aging: int | None = None  # priority scheduling (None: FIFO)


@dataclass(frozen=True)
class Step:
    """One scheduled step, the same shape for both implementations."""

    step: int
    is_prefill: bool
    admitted: int
    layout: PlanLayout
    flat: list[int]
    rids: list[int]
    sample_rids: list[int]


@dataclass(frozen=True)
class Commit:
    step: int
    codes: list[int]
    rids: list[int]
    finished: list[tuple[int, list[int]]]


class Py:
    """The Python reference in pipelined mode."""

    def __init__(self, c: Cfg) -> None:
        self.cfg = c
        self.s = Scheduler(num_pages=c.num_pages, page_size=c.page_size,
                           max_seq_len=c.max_seq_len, max_running_requests=c.max_running,
                           max_extend_tokens=c.max_extend,
                           cache_type="radix" if c.radix else "naive",
                           eos_token_ids=[EOS], priority_aging_steps=c.aging)  # fmt: skip

    def add(self, rid: int, ids: list[int], p: SamplingParams, priority: int = 0) -> None:
        self.s.add_request(ids, p, rid=rid, priority=priority)

    def schedule(self) -> Step | None:
        a = self.s.schedule_ahead()
        if a is None:
            return None
        flat = FlatStep.of(a.plan, a.batch_pos)
        rids = [r.rid for r in a.reqs]
        sample = [rids[i] for i in a.plan.sample_rows.tolist()]
        return Step(a.step, a.plan.is_prefill, a.admitted, flat.layout, flat.data.tolist(),
                    rids, sample)  # fmt: skip

    def commit(self, tokens: list[int]) -> Commit:
        out = self.s.commit_oldest(tokens)
        codes = [FINISH_REASONS.index(o.finish_reason) for o in out.outputs]
        return Commit(out.step, codes, [o.rid for o in out.outputs], out.finished)

    def retire(self, rid: int, abort: bool) -> bool:
        return self.s.retire(rid, abort)

    def state(self) -> dict:
        s = self.s
        reqs = {
            rid: (r.kv_len, r.alloc_len, r.cache_len, r.slot, r.cached_tokens, r.output_ids)
            for rid, r in s.requests.items()
        }
        return {
            "free_pages": list(s.alloc._free_pages),
            "cached": s.cache.evictable_size + s.cache.protected_size,
            "protected": s.cache.protected_size,
            "running": len(s.running),
            "waiting": len(s.waiting),
            "waiting_order": [r.rid for r in s.waiting],
            "inflight": s.num_inflight,
            "retiring": s.num_retiring,
            "reqs": reqs,
        }

    def check(self) -> None:
        self.s.check_integrity()


class Rs:
    """`minisgl_cpu.SchedulerCore` in pipelined mode."""

    def __init__(self, c: Cfg) -> None:
        self.cfg = c
        self.c = extension().SchedulerCore(num_pages=c.num_pages, page_size=c.page_size,
                                           max_seq_len=c.max_seq_len,
                                           max_running_requests=c.max_running,
                                           max_extend_tokens=c.max_extend, radix=c.radix,
                                           eos_token_ids=[EOS],
                                           priority_aging_steps=c.aging)  # fmt: skip
        self.rids: set[int] = set()

    def add(self, rid: int, ids: list[int], p: SamplingParams, priority: int = 0) -> None:
        c = self.cfg
        prompt, max_total = validate_request(ids, p, c.max_seq_len, c.num_pages, c.page_size)
        self.c.add_request(rid, prompt, max_total, p.max_tokens, p.ignore_eos,
                           list(p.stop_token_ids or ()), priority)  # fmt: skip
        self.rids.add(rid)

    def schedule(self) -> Step | None:
        a = self.c.schedule_ahead()
        if a is None:
            return None
        step, is_prefill, admitted, sizes, flat, rids = a
        layout = PlanLayout(*sizes)
        seg = dict((n, (o, k)) for n, o, k in layout.segments())
        o, k = seg["sample_rows"]
        sample = [rids[i] for i in flat[o : o + k].tolist()]
        return Step(step, is_prefill, admitted, layout, flat.tolist(), list(rids), sample)

    def commit(self, tokens: list[int]) -> Commit:
        step, codes, rids, finished = self.c.commit_oldest(tokens)
        return Commit(step, list(codes), list(rids), [(k, list(o)) for k, o in finished])

    def retire(self, rid: int, abort: bool) -> bool:
        return self.c.retire(rid, abort)

    def state(self) -> dict:
        c = self.c
        reqs = {}
        for rid in sorted(self.rids):
            info = c.request_info(rid)
            if info is not None:
                reqs[rid] = (*info[:5], c.output_ids(rid).tolist())
        return {
            "free_pages": c.free_pages().tolist(),
            "cached": c.evictable_size + c.protected_size,
            "protected": c.protected_size,
            "running": c.num_running,
            "waiting": c.num_waiting,
            "waiting_order": list(c.waiting_rids()),
            "inflight": c.num_inflight,
            "retiring": c.num_retiring,
            "reqs": reqs,
        }

    def check(self) -> None:
        self.c.check_integrity()


def _page_set(s: Step, ps: int) -> set[int]:
    seg = {n: (o, k) for n, o, k in s.layout.segments()}
    o, k = seg["kv_indices"]
    return {loc // ps for loc in s.flat[o : o + k]}


class PipelinedMachine(RuleBasedStateMachine):
    """add / schedule_ahead / commit_oldest / retire on both implementations, at most two (or
    three) steps in flight, FIFO or priority scheduling (the waiting order is compared);
    everything observable must agree after every rule."""

    @initialize(
        page_size=st.sampled_from([1, 4]),
        num_pages=st.integers(24, 96),
        max_running=st.integers(1, 5),
        max_extend=st.integers(4, 40),
        radix=st.sampled_from([True, True, False]),
        depth=st.sampled_from([2, 2, 3]),
        aging=st.sampled_from([None, None, 1, 3]),
    )
    def setup(self, page_size, num_pages, max_running, max_extend, radix, depth, aging):
        self.cfg = Cfg(num_pages // page_size, page_size, 64, max_running, max_extend, radix,
                       aging)  # fmt: skip
        self.py, self.rs = Py(self.cfg), Rs(self.cfg)
        self.stems = [[1, 2, 3, 4, 6, 7, 8, 9], [9, 9, 8, 8, 7, 7]]
        self.next_rid = 0
        self.queue: deque[Step] = deque()
        self.depth = depth  # steps in flight at most (the service uses 2)

    @precondition(lambda self: len(self.py.s.requests) < 5)  # leave room for decode steps
    @rule(stem=st.integers(0, 2), cut=st.integers(0, 8), tail=st.lists(st.integers(1, 9),
          max_size=20), max_tokens=st.integers(1, 10), ignore_eos=st.booleans(),
          stop=st.booleans(), priority=st.integers(-2, 2))  # fmt: skip
    def add(self, stem, cut, tail, max_tokens, ignore_eos, stop, priority):
        ids = (self.stems[stem][:cut] if stem < 2 else []) + tail
        p = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos,
                           stop_token_ids=[STOP] if stop else None)  # fmt: skip
        rid = self.next_rid
        self.next_rid += 1
        try:
            self.py.add(rid, ids, p, priority)
        except RequestError:
            with pytest.raises(RequestError):
                self.rs.add(rid, ids, p, priority)
            return
        self.rs.add(rid, ids, p, priority)

    @precondition(lambda self: len(self.queue) < self.depth)
    @rule()
    def schedule(self):
        a, b = self.py.schedule(), self.rs.schedule()
        assert a == b
        if a is None:
            return
        # a -1 input only in a decode step while an earlier step is in flight
        o, k = dict((n, (o, k)) for n, o, k in a.layout.segments())["input_ids"]
        if a.is_prefill or not self.queue:
            assert -1 not in a.flat[o : o + k]
        self.queue.append(a)

    @precondition(lambda self: self.queue)
    @rule(data=st.data())
    def commit(self, data):
        step = self.queue.popleft()
        n = len(step.sample_rids)
        toks = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
        a, b = self.py.commit(toks), self.rs.commit(toks)
        assert a == b
        assert a.step == step.step and a.rids == step.sample_rids

    @precondition(lambda self: self.next_rid > 0)
    @rule(data=st.data(), abort=st.booleans(), live=st.integers(0, 3))
    def retire(self, data, abort, live):
        # mostly a live request (running ones are the interesting case), sometimes any id
        running = [r.rid for r in self.py.s.running]
        pool = running if running and live else sorted(self.py.s.requests) if live else []
        rid = data.draw(st.sampled_from(pool) if pool else st.integers(0, self.next_rid))
        assert self.py.retire(rid, abort) == self.rs.retire(rid, abort)

    @invariant()
    def same_state(self):
        if not hasattr(self, "py"):
            return
        assert self.py.state() == self.rs.state()
        self.py.check()
        self.rs.check()
        # no page an unconfirmed step reads is free (check() asserts it too; this is the
        # caller's view through the plans)
        free = set(self.py.state()["free_pages"])
        for s in self.queue:
            assert not (_page_set(s, self.cfg.page_size) & free)


TestPipelinedEquivalence = pytest.mark.rust_ext(PipelinedMachine.TestCase)
TestPipelinedEquivalence.settings = SETTINGS


@pytest.mark.parametrize("impl", [Py, pytest.param(Rs, marks=pytest.mark.rust_ext)])
@pytest.mark.parametrize("radix", [True, False])
def test_retired_pages_stay_reserved_until_the_reading_step_commits(impl, radix):
    """A request that stops in step N (detected at commit N) while step N+1 is in flight,
    and one aborted while a step is in flight: their tokens of the later step are dropped, and
    no page or slot that step uses goes to another request before it is committed."""
    s = impl(Cfg(40, 1, 64, 3, 32, radix))
    s.add(1, [1, 2, 3, 4], SamplingParams(max_tokens=8))
    s.add(2, [6, 7, 8], SamplingParams(max_tokens=8))
    s0 = s.schedule()
    assert s0.is_prefill and s0.rids == [1, 2]
    s1 = s.schedule()
    seg = {n: (o, k) for n, o, k in s1.layout.segments()}
    o, k = seg["input_ids"]
    assert not s1.is_prefill and s1.flat[o : o + k] == [-1, -1]
    assert s.commit([9, 9]).codes == [0, 0]
    s2 = s.schedule()
    read = _page_set(s2, 1)  # ps = 1: a location is a page
    o, k = seg["slots"]
    busy_slots = set(s2.flat[o : o + k])
    c1 = s.commit([EOS, 6])  # request 1 stops; step 2 still reads its pages
    assert (c1.codes, c1.finished) == ([1, 0], [(0, [9, EOS])])
    assert s.retire(2, True)  # abort while step 2 is in flight
    assert s.state()["retiring"] == 2 and s.state()["running"] == 0
    assert not read & set(s.state()["free_pages"])
    s.check()
    # a new request is admitted (pages and a slot to spare), but on none of theirs
    s.add(3, list(range(1, 17)), SamplingParams(max_tokens=4, ignore_eos=True))
    s3 = s.schedule()
    assert s3.rids == [3] and s3.admitted == 1
    seg3 = {n: (o, k) for n, o, k in s3.layout.segments()}
    o, k = seg3["out_loc"]
    assert not set(s3.flat[o : o + k]) & read
    o, k = seg3["slots"]
    assert s3.flat[o] not in busy_slots
    s.check()
    c2 = s.commit([4, 4])
    assert c2.codes == [FINISH_REASONS.index(DROPPED)] * 2 and s.state()["retiring"] == 0
    s.check()
    # cached: 1's 6 known tokens, 2's 3 cached prompt tokens, 3's prompt beyond [1, 2, 3, 4]
    assert s.state()["cached"] == (6 + 3 + 12 if radix else 0)


@pytest.mark.parametrize("impl", [Py, pytest.param(Rs, marks=pytest.mark.rust_ext)])
@pytest.mark.parametrize("radix", [True, False])
def test_stop_string_retire_with_two_steps_in_flight_caches_only_known_tokens(impl, radix):
    """Retired (not aborted) while two decode steps contain it: both samples are dropped and
    `kv_len` is one position ahead of the known tokens; release caches only the known ones."""
    s = impl(Cfg(32, 1, 64, 2, 32, radix))
    s.add(1, [1, 2, 3, 4], SamplingParams(max_tokens=8, ignore_eos=True))
    s.schedule()  # prefill
    s.schedule()  # decode, input -1
    s.commit([7])
    s.schedule()  # decode, input -1
    assert s.retire(1, False) and s.state()["retiring"] == 1
    assert s.commit([7]).codes == [3] and s.commit([7]).codes == [3]
    s.check()
    st_ = s.state()
    assert st_["retiring"] == 0 and st_["free_pages"][-1] == 5  # position 5 (kv) was freed
    assert st_["cached"] == (5 if radix else 0)  # prompt + the one committed token


@pytest.mark.rust_ext
def test_codes_and_trace_version_agree_with_the_extension():
    from minisgl.scheduler import replay

    assert FINISH_REASONS.index(DROPPED) == extension().FINISH_DROPPED == 3
    assert replay.TRACE_VERSION == extension().TRACE_VERSION


def _drive(s, depth: int, reqs: list[tuple[list[int], int]]) -> dict[int, list[int]]:
    """Run to completion with `depth` steps in flight; token = f(rid, output index)."""
    for rid, (prompt, n) in enumerate(reqs):
        s.add(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    queue: deque[list[int]] = deque()
    count: dict[int, int] = {}
    outs: dict[int, list[int]] = {}
    while True:
        step = s.schedule() if len(queue) < depth else None
        if step is not None:
            toks = []
            for rid in step.sample_rids:
                toks.append(1 + (rid * 3 + count.get(rid, 0)) % 5)
                count[rid] = count.get(rid, 0) + 1
            queue.append(toks)
            s.check()
            continue
        if not queue:
            break
        c = s.commit(queue.popleft())
        assert FINISH_REASONS.index(DROPPED) not in c.codes
        outs.update((c.rids[k], o) for k, o in c.finished)
        s.check()
    st = s.state()
    assert st["running"] == st["waiting"] == st["inflight"] == st["retiring"] == 0
    return outs


@pytest.mark.rust_ext
@pytest.mark.parametrize("radix", [True, False])
def test_pipelined_outputs_equal_serial_when_finishing_by_length(radix):
    rng = np.random.default_rng(3)
    reqs = [(rng.integers(1, 6, size=int(rng.integers(1, 20))).tolist(), int(rng.integers(1, 12)))
            for _ in range(10)]  # fmt: skip
    cfg = Cfg(24, 4, 64, 3, 12, radix)
    serial = Scheduler(num_pages=24, page_size=4, max_seq_len=64, max_running_requests=3,
                       max_extend_tokens=12, cache_type="radix" if radix else "naive",
                       eos_token_ids=[EOS])  # fmt: skip
    for rid, (prompt, n) in enumerate(reqs):
        serial.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), rid=rid)
    want: dict[int, list[int]] = {}
    while serial.has_work():
        plan, batch = serial.schedule()
        rows = [batch[r] for r in plan.sample_rows.tolist()]
        toks = [1 + (r.rid * 3 + len(r.output_ids)) % 5 for r in rows]
        for o in serial.commit(batch, plan, toks):
            if o.finish_reason is not None:
                want[o.rid] = next(r for r in rows if r.rid == o.rid).output_ids
    assert len(want) == len(reqs) and all(len(want[i]) == n for i, (_, n) in enumerate(reqs))
    assert _drive(Py(cfg), 2, reqs) == want
    assert _drive(Rs(cfg), 2, reqs) == want


def _traced_run(tmp_path, tamper=None):
    cfg = Cfg(40, 4, 64, 3, 10, True)
    rs = Rs(cfg)
    rs.c.enable_trace()
    rng = np.random.default_rng(7)
    queue: deque[Step] = deque()
    stem = [1, 2, 3, 4, 6, 7, 8, 9]
    for rid in range(12):
        ids = stem[: int(rng.integers(0, 9))] + rng.integers(1, 9, size=4).tolist()
        p = SamplingParams(max_tokens=int(rng.integers(1, 9)), stop_token_ids=[STOP])
        rs.add(rid, ids, p)
        for _ in range(3):
            if len(queue) < 2 and (s := rs.schedule()) is not None:
                queue.append(s)
            elif queue:
                rs.commit(rng.integers(0, 7, size=len(queue.popleft().sample_rids)).tolist())
        if rid % 4 == 3:
            rs.retire(int(rng.integers(0, rid)), bool(rng.integers(0, 2)))
    while queue or rs.state()["running"] or rs.state()["waiting"]:
        if len(queue) < 2 and (s := rs.schedule()) is not None:
            queue.append(s)
        else:
            rs.commit(rng.integers(0, 7, size=len(queue.popleft().sample_rids)).tolist())
    rs.check()
    lines = rs.c.take_trace().splitlines()
    if tamper is not None:
        lines = tamper(lines)
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, lines


@pytest.mark.rust_ext
def test_trace_replay_round_trip(tmp_path):
    path, lines = _traced_run(tmp_path)
    events = [json.loads(x)["ev"] for x in lines]
    assert events[0] == "config" and {"add", "schedule", "commit", "retire"} <= set(events)
    steps = [json.loads(x) for x in lines if '"schedule"' in x and '"step":null' not in x]
    assert any(-1 in s["plan"] for s in steps)  # decode inputs still in flight were recorded
    assert any(3 in json.loads(x)["codes"] for x in lines if '"commit"' in x)  # a dropped one
    report = replay_trace(path)
    assert report.ok and report.mismatches == 0, report
    assert report.steps == len(steps) and report.events == len(lines) - 1
    proc = subprocess.run([sys.executable, "-m", "minisgl.scheduler.replay", str(path)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"] is True


def _tamper_plan(lines):
    """Change one kv index of the 4th scheduled step."""
    out, seen = list(lines), 0
    for i, x in enumerate(lines):
        ev = json.loads(x)
        if ev["ev"] == "schedule" and ev["step"] is not None:
            seen += 1
            if seen == 4:
                layout = PlanLayout(*ev["layout"])
                _, off, n = next(s for s in layout.segments() if s[0] == "kv_indices")
                ev["plan"][off + n - 1] += 1
                out[i] = json.dumps(ev)
                return out
    raise AssertionError("fewer than 4 steps")


@pytest.mark.rust_ext
def test_tampered_trace_is_a_mismatch(tmp_path, capsys):
    path, _ = _traced_run(tmp_path, _tamper_plan)
    report = replay_trace(path)
    assert not report.ok and report.mismatches == 1
    m = report.mismatch
    assert (m.event, m.step, m.segment) == ("schedule", 3, "kv_indices")
    assert m.expected != m.got
    assert replay_main([str(path)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["mismatch"]["segment"] == "kv_indices" and out["mismatch"]["step"] == 3

    # a changed token: the commit codes (or a later plan) no longer agree
    def tamper_tokens(lines):
        out = list(lines)
        for i, x in enumerate(lines):
            ev = json.loads(x)
            if ev["ev"] == "commit" and 1 in ev["codes"]:
                k = ev["codes"].index(1)
                ev["tokens"][k] = 1  # was a stop / EOS token
                out[i] = json.dumps(ev)
                return out
        raise AssertionError("no stop in the trace")

    path, _ = _traced_run(tmp_path, tamper_tokens)
    report = replay_trace(path)
    assert not report.ok and report.mismatch.event == "commit"
    assert report.mismatch.segment == "codes"


def test_unreadable_trace_is_an_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ev": "add", "rid": 1}\n')
    assert replay_main([str(bad)]) == 2
    assert "config" in json.loads(capsys.readouterr().out)["error"]
    bad.write_text('{"ev": "config", "version": 1, "num_pages": 8, "page_size": 1, '
                   '"max_seq_len": 16, "max_running": 2, "max_extend_tokens": 8, '
                   '"radix": true, "eos_token_ids": []}\nnot json\n')  # fmt: skip
    assert replay_main([str(bad)]) == 2
    assert ":2:" in json.loads(capsys.readouterr().out)["error"]
