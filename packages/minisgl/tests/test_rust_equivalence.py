"""The Rust CPU core (`minisgl_cpu`) against the Python reference: random operation sequences
(hypothesis stateful tests) must give identical results, node ids, plans and integrity."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minisgl.core import SamplingParams
from minisgl.kvcache import RadixCache
from minisgl.scheduler.backend import SchedulerConfig
from minisgl.scheduler.factory import make_scheduler
from minisgl.scheduler.scheduler import Scheduler
from minisgl.step.plan import PLAN_FIELDS, PlanLayout, build_step_plan
from minisgl.testing.rust_hotpath import RustRadixCache, RustScheduler

pytestmark = pytest.mark.rust_ext  # the whole module compares with the PyO3 core

SETTINGS = settings(max_examples=150, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])  # fmt: skip

# small alphabet + a few shared stems -> many splits and partial matches
tokens_st = st.lists(st.integers(1, 4), min_size=0, max_size=24)


class RadixMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size):
        self.ps = page_size
        self.py = RadixCache(page_size)
        self.rs = RustRadixCache(page_size)
        self.next_loc = 0
        self.locked: list[tuple[object, object]] = []

    def _aligned(self, toks):
        n = len(toks) // self.ps * self.ps
        return np.array(toks[:n], dtype=np.int32)

    @rule(toks=tokens_st)
    def insert(self, toks):
        t = self._aligned(toks)
        idx = np.arange(self.next_loc, self.next_loc + len(t), dtype=np.int32)
        self.next_loc += len(t)
        assert self.py.insert(t, idx) == self.rs.insert(t, idx)

    @rule(toks=tokens_st, lock=st.booleans())
    def match(self, toks, lock):
        t = np.array(toks, dtype=np.int32)
        a, b = self.py.match_prefix(t), self.rs.match_prefix(t)
        assert a.indices.tolist() == b.indices.tolist()
        assert a.node.id == self.rs.node_id(b.node)
        if lock:
            self.py.lock(a.node)
            self.rs.lock(b.node)
            self.locked.append((a.node, b.node))

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locked) - 1))
        a, b = self.locked.pop(i)
        self.py.unlock(a)
        self.rs.unlock(b)

    @rule(n=st.integers(0, 40))
    def evict(self, n):
        assert self.py.evict(n).tolist() == self.rs.evict(n).tolist()

    @invariant()
    def same_state(self):
        if not hasattr(self, "py"):
            return
        assert self.py.evictable_size == self.rs.evictable_size
        assert self.py.protected_size == self.rs.protected_size
        assert sorted(self.py.all_indices().tolist()) == sorted(self.rs.all_indices().tolist())
        self.py.check_integrity()
        self.rs.check_integrity()


TestRadixEquivalence = pytest.mark.card(
    "P0-003",
    "page-aligned-match-and-insert",
    "lru-eviction-of-unlocked-leaves",
    "lock-and-unlock-reference-counting",
    "random-operation-sequences-agree-with-the-python-reference",
)(
    pytest.mark.card("P0-004", "rust-radix-cache-behind-the-python-prefixcache-interface")(
        RadixMachine.TestCase
    )
)
TestRadixEquivalence.settings = SETTINGS


class SchedulerMachine(RuleBasedStateMachine):
    """add / schedule+commit (step) / abort / finish on both schedulers."""

    @initialize(
        page_size=st.sampled_from([1, 4]),
        num_pages=st.integers(24, 96),
        max_running=st.integers(1, 6),
        max_extend=st.integers(4, 40),
        cache_type=st.sampled_from(["radix", "radix", "naive"]),
        in_batch=st.sampled_from([0, 2, 4, 32]),  # the in-batch prefix check's threshold
    )
    def setup(self, page_size, num_pages, max_running, max_extend, cache_type, in_batch):
        cfg = SchedulerConfig(num_pages=num_pages // page_size, page_size=page_size,
                              max_seq_len=64, max_running_requests=max_running,
                              max_extend_tokens=max_extend, cache_type=cache_type,
                              eos_token_ids=(0,), in_batch_prefix_min=in_batch)  # fmt: skip
        self.py = make_scheduler(cfg, "python", shadow=False)
        self.rs = make_scheduler(cfg, "rust_hotpath", shadow=False)
        assert type(self.py) is Scheduler and isinstance(self.rs, RustScheduler)
        self.stems = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 8, 8, 7, 7]]

    @rule(stem=st.integers(0, 2), cut=st.integers(0, 8), tail=st.lists(st.integers(1, 6),
          max_size=20), max_tokens=st.integers(1, 10), ignore_eos=st.booleans(),
          stop=st.sampled_from([None, (5,)]))  # fmt: skip
    def add(self, stem, cut, tail, max_tokens, ignore_eos, stop):
        ids = (self.stems[stem][:cut] if stem < 2 else []) + tail
        p = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop)
        errs = []
        for s in (self.py, self.rs):
            try:
                errs.append(("ok", s.add_request(ids, p)))
            except Exception as e:
                errs.append((type(e).__name__, str(e)))
        assert errs[0] == errs[1]

    @rule(seed=st.integers(0, 2**16))
    def step(self, seed):
        rng = np.random.default_rng(seed)
        a, b = self.py.schedule(), self.rs.schedule()
        assert (a is None) == (b is None)
        if a is None:
            return
        assert a[0].is_prefill == b[0].is_prefill
        for f in PLAN_FIELDS:
            x, y = getattr(a[0], f), getattr(b[0], f)
            assert x.dtype == y.dtype and np.array_equal(x, y), f
        assert [r.rid for r in a[1]] == [r.rid for r in b[1]]
        toks = rng.integers(0, 7, size=len(a[0].sample_rows)).tolist()
        oa, ob = self.py.commit(a[1], a[0], toks), self.rs.commit(b[1], b[0], toks)
        assert list(oa) == list(ob)

    @precondition(lambda self: self.py.requests)
    @rule(data=st.data(), reason=st.sampled_from(["abort", "stop"]))
    def finish(self, data, reason):
        rid = data.draw(st.sampled_from(sorted(self.py.requests)))
        assert self.py.finish(rid, reason) == self.rs.finish(rid, reason)

    @invariant()
    def same_state(self):
        if not hasattr(self, "py"):
            return
        assert self.py.kv_usage() == self.rs.kv_usage()
        assert sorted(self.py.requests) == sorted(self.rs.requests)
        for rid, r in self.py.requests.items():
            q = self.rs.requests[rid]
            assert (r.kv_len, r.alloc_len, r.cache_len, r.slot, r.output_ids) == (
                q.kv_len, q.alloc_len, q.cache_len, q.slot, q.output_ids)  # fmt: skip
        assert self.py.stats.cached_prompt_tokens == self.rs.stats.cached_prompt_tokens
        self.py.check_integrity()
        self.rs.check_integrity()


TestSchedulerEquivalence = pytest.mark.card(
    "P0-003",
    "admission-and-step-plans-identical-to-the-python-scheduler",
    "random-operation-sequences-agree-with-the-python-reference",
)(
    pytest.mark.card("P0-004", "rust-scheduler-behind-the-python-scheduler-interface")(
        SchedulerMachine.TestCase
    )
)
TestSchedulerEquivalence.settings = SETTINGS


@pytest.mark.card("P0-003", "admission-and-step-plans-identical-to-the-python-scheduler")
@settings(max_examples=80, deadline=None)
@given(data=st.data(), bs=st.integers(0, 5), prefill=st.booleans())
def test_build_plan_matches_python(data, bs, prefill):
    import minisgl_cpu

    width = 16
    pt = np.arange(4 * width, dtype=np.int32).reshape(4, width) * 3 + 1
    slots = np.array(data.draw(st.lists(st.integers(0, 3), min_size=bs, max_size=bs)), np.int32)
    starts = np.array(data.draw(st.lists(st.integers(0, 8), min_size=bs, max_size=bs)), np.int32)
    ext = np.array(data.draw(st.lists(st.integers(1, 8), min_size=bs, max_size=bs)), np.int32)
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=bs, max_size=bs)), bool)
    ids = np.arange(int(ext.sum()), dtype=np.int32)
    ref = build_step_plan(pt, slots, starts, ext, ids, mask, prefill)
    (b, t, kv, ns), flat = minisgl_cpu.build_plan(pt.reshape(-1), width, slots, starts, ext,
                                                  ids, mask, prefill)  # fmt: skip
    layout = PlanLayout(b, t, kv, ns)
    assert layout == PlanLayout.of(ref) and len(flat) == layout.total
    for name, o, n in layout.segments():
        want = slots if name == "batch_pos" else getattr(ref, name)  # build_plan passes slots
        assert flat[o : o + n].tolist() == want.tolist(), name


@pytest.mark.card("P0-003", "batched-radix-calls-agree-with-per-sequence-calls")
def test_radix_batch_calls_match_single_calls():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 5, size=rng.integers(1, 40)).astype(np.int32) for _ in range(50)]
    a, b = RustRadixCache(1), RustRadixCache(1)
    offs = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in seqs], out=offs[1:])
    flat = np.concatenate(seqs)
    locs = np.arange(len(flat), dtype=np.int32)
    single = [a.insert(s, locs[offs[i] : offs[i + 1]]) for i, s in enumerate(seqs)]
    assert b.insert_batch(flat, offs, locs).tolist() == single
    assert b.match_batch(flat, offs).tolist() == [a.match_prefix(s).length for s in seqs]
    a.check_integrity()
    b.check_integrity()


class _CountingCore:
    """Stands in for the extension object of a `RustScheduler` and counts every crossing."""

    def __init__(self, core) -> None:
        self._core = core
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        attr = getattr(self._core, name)
        if not callable(attr):
            self.calls.append(name)
            return attr

        def counted(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)

        return counted


@pytest.mark.card("P0-004", "one-call-into-rust-per-decode-schedule-and-per-commit")
@pytest.mark.parametrize("batch", [1, 32])
def test_decode_step_crosses_once_per_schedule_and_commit(batch):
    s = RustScheduler(num_pages=batch * 64, page_size=4, max_seq_len=128,
                      max_running_requests=batch, max_extend_tokens=512, cache_type="radix",
                      eos_token_ids=[0])  # fmt: skip
    rng = np.random.default_rng(0)
    for _ in range(batch):
        s.add_request(rng.integers(1, 50, size=20).tolist(), SamplingParams(max_tokens=30))
    while True:  # prefill everything
        plan, reqs = s.schedule()
        s.commit(reqs, plan, [7] * len(plan.sample_rows))
        if not plan.is_prefill:
            break
    counting = _CountingCore(s.core)
    s.core = counting
    for i in range(10):
        plan, reqs = s.schedule()
        assert not plan.is_prefill and len(plan.sample_rows) == batch
        assert counting.calls == ["schedule_step"], counting.calls
        counting.calls.clear()
        outs = s.commit(reqs, plan, [8 + i] * batch)
        assert [o.token_id for o in outs] == [8 + i] * batch
        assert counting.calls == ["commit_step"], counting.calls
        counting.calls.clear()
