"""The vectorised hot path of the Python scheduler (issue 39): the step plan (built whole, or
extended from the previous decode step's), batched page allocation and the per-slot request
state give exactly what the per-request code gave, and a large decode batch (the size the
step-cost benchmark runs) stays decision-identical to the Rust core in serial and pipelined
mode, eviction and stop tokens included."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.core import SamplingParams
from minisgl.kvcache.allocator import PageAllocator
from minisgl.scheduler.request import FINISH_REASONS, validate_request
from minisgl.scheduler.scheduler import Scheduler
from minisgl.step.plan import (
    PLAN_FIELDS,
    FlatStep,
    StepPlan,
    build_step_plan,
    next_decode_plan,
)
from minisgl.testing.rust_hotpath import extension


def _reference_plan(pt, slots, starts, lens, ids, mask, is_prefill) -> StepPlan:
    """The plan written one request at a time (what `build_step_plan` must equal)."""
    positions, out_loc, kv, seq, logits, rows = [], [], [], [], [], []
    q = 0
    for i, (s, a, n) in enumerate(zip(slots, starts, lens, strict=True)):
        positions += list(range(a, a + n))
        out_loc += pt[s, a : a + n].tolist()
        kv += pt[s, : a + n].tolist()
        seq.append(a + n)
        q += n
        if mask[i]:
            logits.append(q - 1)
            rows.append(i)
    i32 = np.int32
    return StepPlan(is_prefill, np.array(slots, i32), np.array(lens, i32), np.array(seq, i32),
                    np.concatenate([[0], np.cumsum(seq)]).astype(i32), np.array(ids, i32),
                    np.array(positions, i32), np.array(out_loc, i32), np.array(kv, i32),
                    np.array(logits, i32), np.array(rows, i32))  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(data=st.data(), bs=st.integers(0, 12), width=st.sampled_from([8, 32]),
       prefill=st.booleans())  # fmt: skip
def test_build_step_plan_equals_the_per_request_plan(data, bs, width, prefill):
    rows = 16
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    pt = rng.integers(0, 10_000, size=(rows, width)).astype(np.int32)
    slots = rng.permutation(rows)[:bs] if bs <= rows else np.zeros(0, int)
    starts = [data.draw(st.integers(0, width - 1)) for _ in slots]
    lens = [data.draw(st.integers(0 if prefill else 1, width - a)) for a in starts]
    mask = [data.draw(st.booleans()) for _ in slots]
    ids = rng.integers(0, 100, size=sum(lens)).astype(np.int32)
    got = build_step_plan(pt, np.array(slots, np.int32), np.array(starts, np.int32),
                          np.array(lens, np.int32), ids, np.array(mask, bool), prefill)  # fmt: skip
    want = _reference_plan(pt, list(slots), starts, lens, ids, mask, prefill)
    assert got.is_prefill == want.is_prefill
    for f in PLAN_FIELDS:
        x, y = getattr(got, f), getattr(want, f)
        assert x.dtype == np.int32 and x.tolist() == y.tolist(), f


@settings(max_examples=100, deadline=None)
@given(data=st.data(), bs=st.integers(0, 12), steps=st.integers(1, 4))
def test_next_decode_plan_equals_a_full_build(data, bs, steps):
    """Decode steps of the same requests, one token further each time: the KV read mapping
    extended from the previous plan equals the one gathered again from the page table."""
    rows, width = 16, 32
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    pt = rng.integers(0, 10_000, size=(rows, width)).astype(np.int32)
    slots = rng.permutation(rows)[:bs].astype(np.int32)
    starts = np.array([data.draw(st.integers(0, width - 1 - steps)) for _ in slots], np.int32)
    ones, every = np.ones(bs, np.int32), np.ones(bs, bool)
    plan = build_step_plan(pt, slots, starts, ones, np.zeros(bs, np.int32), every, False)
    for _ in range(steps):
        ids = rng.integers(0, 100, size=bs).astype(np.int32)
        got = next_decode_plan(plan, pt, ids)
        want = build_step_plan(pt, slots, plan.seq_lens, ones, ids, every, False)
        assert got.is_prefill is False
        for f in PLAN_FIELDS:
            x, y = getattr(got, f), getattr(want, f)
            assert x.dtype == np.int32 and x.tolist() == y.tolist(), f
        plan = got


@settings(max_examples=100, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 4]))
def test_batched_page_allocation_equals_one_request_at_a_time(data, page_size):
    slots_n, width_pages = 8, 6
    a = PageAllocator(64, page_size, slots_n, width_pages * page_size)
    b = PageAllocator(64, page_size, slots_n, width_pages * page_size)
    order = data.draw(st.permutations(range(6)))
    for alloc in (a, b):  # a shuffled free stack, as after frees
        alloc.alloc_pages(0, 0, 6)
        for i in order:
            alloc.free_locations(alloc.page_table[0, i * page_size : (i + 1) * page_size])
    k = data.draw(st.integers(0, slots_n))
    slots = np.array(data.draw(st.permutations(range(slots_n)))[:k], np.int64)
    starts = np.array([data.draw(st.integers(0, 3)) * page_size for _ in slots], np.int64)
    counts = np.array([data.draw(st.integers(0, 2)) for _ in slots], np.int64)
    for s, at, n in zip(slots.tolist(), starts.tolist(), counts.tolist(), strict=True):
        a.alloc_pages(s, at, n)
    b.alloc_pages_batch(slots, starts, counts)
    assert np.array_equal(a.page_table, b.page_table)
    assert a._free_pages == b._free_pages


# ------------------------------------------------------------------ python vs rust, large batch
def _py(ps: int, num_pages: int, cache: str) -> Scheduler:
    return Scheduler(num_pages=num_pages, page_size=ps, max_seq_len=256,
                     max_running_requests=96, max_extend_tokens=512, cache_type=cache,
                     eos_token_ids=[0])  # fmt: skip


def _rs(ps: int, num_pages: int, cache: str):
    return extension().SchedulerCore(
        num_pages=num_pages, page_size=ps, max_seq_len=256, max_running_requests=96,
        max_extend_tokens=512, radix=cache == "radix", eos_token_ids=[0],
        priority_aging_steps=None,
    )  # fmt: skip


def _requests(seed: int, n: int) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(seed)
    stems = [rng.integers(1, 50, size=24).tolist() for _ in range(4)]
    out = []
    for i in range(n):
        ids = stems[i % 4][: int(rng.integers(0, 24))] + rng.integers(1, 50, size=int(
            rng.integers(1, 40))).tolist()  # fmt: skip
        p = SamplingParams(max_tokens=int(rng.integers(1, 60)), ignore_eos=bool(i % 3),
                           stop_token_ids=(5,) if i % 7 == 0 else None)  # fmt: skip
        out.append((ids, p))
    return out


@pytest.mark.rust_ext
@pytest.mark.parametrize("ps,num_pages,cache", [(1, 6000, "radix"), (4, 1500, "naive"),
                                                 (1, 1200, "radix"), (4, 300, "radix")])  # fmt: skip
@pytest.mark.parametrize("pipelined", [False, True])
def test_large_decode_batch_is_decision_identical_to_the_rust_core(ps, num_pages, cache,
                                                                  pipelined):  # fmt: skip
    """96 running requests (small pools: admission waits and the prefix cache is evicted)."""
    py, rs = _py(ps, num_pages, cache), _rs(ps, num_pages, cache)
    for rid, (ids, p) in enumerate(_requests(ps + num_pages, 160)):
        py.add_request(ids, p, rid=rid)
        prompt, max_total = validate_request(ids, p, 256, num_pages, ps)
        rs.add_request(rid, prompt, max_total, p.max_tokens, p.ignore_eos,
                       list(p.stop_token_ids or ()), 0)  # fmt: skip
    rng = np.random.default_rng(0)
    inflight = 0
    for _ in range(2000):
        if pipelined:
            a, b = py.schedule_ahead(), rs.schedule_ahead()
            assert (a is None) == (b is None)
            if a is not None:
                _, is_prefill, admitted, _, flat, rids = b
                assert (a.plan.is_prefill, a.admitted) == (is_prefill, admitted)
                assert FlatStep.of(a.plan, a.batch_pos).data.tolist() == flat.tolist()
                assert [r.rid for r in a.reqs] == list(rids)
                inflight += 1
            if inflight and (inflight == 2 or a is None):
                n = len(py._inflight[0].sample_rows)
                toks = rng.integers(0, 8, size=n).tolist()
                x, (_, codes, rids, fin) = py.commit_oldest(toks), rs.commit_oldest(toks)
                assert [FINISH_REASONS.index(o.finish_reason) for o in x.outputs] == list(codes)
                assert [o.rid for o in x.outputs] == list(rids)
                assert x.finished == [(k, list(o)) for k, o in fin]
                inflight -= 1
            elif a is None:
                break
        else:
            planned = py.schedule()
            out = rs.schedule_step()
            if planned is None:
                assert out is None
                break
            plan, reqs = planned
            is_prefill, _admitted, bs, *_sizes, flat = out
            assert plan.is_prefill == is_prefill
            want = FlatStep.of(plan).data[:-bs]  # batch_pos: the Rust core's own
            assert want.tolist() == flat[:-bs].tolist()
            toks = rng.integers(0, 8, size=len(plan.sample_rows)).tolist()
            outs = py.commit(reqs, plan, toks)
            codes, _finished = rs.commit_step(toks)
            assert [FINISH_REASONS.index(o.finish_reason) for o in outs] == list(codes)
        assert py.alloc.num_free_pages == rs.num_free_pages
        assert list(py.alloc._free_pages) == rs.free_pages().tolist()
    else:
        pytest.fail("did not drain")
    py.check_integrity()
    rs.check_integrity()
    assert not py.has_work()
