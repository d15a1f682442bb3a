"""Overlap scheduling in-process (`minisgl.runtime.loop`, depth 1): the loop that schedules step N+1 while
the device runs step N gives the serial loop's tokens (and HF's, greedy fp32) across EOS,
stop ids, stop strings, max_tokens, aborts in flight, chunked prefill, prefix sharing and
batch sizes, on a fake device stream (a worker thread, and a slow one); no step writes KV
an unconfirmed step still reads; every page comes back after each scenario."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl import LLM, SamplingParams
from minisgl.engine.stream import InlineStream, ThreadStream, make_stream
from minisgl.runtime.device_step import DeviceStep
from minisgl.runtime.local import LocalPlane
from minisgl.runtime.loop import StepLoop
from minisgl.scheduler.request import DROPPED, FINISH_REASONS, StepOutput, validate_request
from minisgl.scheduler.scheduler import Scheduler
from minisgl.step.plan import FlatStep, PlanLayout
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.rust_hotpath import extension
from minisgl.testing.scenarios import assert_kv_clean, random_prompts
from minisgl.testing.tiny_models import write_tiny_model

STREAMS = ("thread", "slow:2")  # `inline`: every other LLM test runs it (the CPU default)
# two requests of 20 + 40 tokens fill the slot table and nearly the pool (15 pages each)
TIGHT = dict(num_pages=32, max_seq_len_override=64, page_size=4, max_running_requests=2)


def make_llm(path, stream: str | None, **kw) -> LLM:
    kw.setdefault("num_pages", 1024)
    kw.setdefault("max_seq_len_override", 256)
    if stream is None:
        return LLM(path, overlap=False, **kw)
    llm = LLM(path, overlap=True, device_stream=stream, **kw)
    assert llm.runtime.depth == 1 and llm.runtime.loop.stream.name == stream
    watch(llm, stream)  # KV integrity after every schedule and commit
    return llm


def run(llm: LLM, prompts, params) -> list[tuple[list[int], str | None]]:
    out = llm.generate(prompts, params)
    assert_kv_clean(llm)
    return [(o["token_ids"], o["finish_reason"]) for s in out for o in s["outputs"]]


def shared_prefix_prompts(n: int, seed: int) -> list[list[int]]:
    stem = random_prompts(1, 24, 24, seed=seed)[0]
    return [stem + tail for tail in random_prompts(n, 1, 12, seed=seed + 1)]


# --------------------------------------------------------------------------- streams
def test_make_stream_specs():
    cpu = torch.device("cpu")
    assert isinstance(make_stream("auto", cpu), InlineStream)
    slow = make_stream("slow:2.5", cpu)
    assert isinstance(slow, ThreadStream) and slow.delay_s == 0.0025 and slow.name == "slow:2.5"
    slow.close()
    for bad in ("gpu", "slow:x", "slow:-1", "cuda"):
        with pytest.raises(ValueError, match="device stream"):
            make_stream(bad, cpu)


def test_env_switches_overlap_off(tiny_model_dir, monkeypatch):
    kw = dict(num_pages=64, max_seq_len_override=64, sim_device="0,0")
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "1")
    assert LLM(tiny_model_dir("llama"), **kw).runtime.depth == 0
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "0")
    llm = LLM(tiny_model_dir("llama"), **kw)
    assert llm.runtime.depth == 1 and llm.runtime.loop.stream.name == "inline"  # sim: auto
    llm.close()


# --------------------------------------------------------------------------- parity
@pytest.fixture(scope="module")
def eos_model(tiny_model_dir, tmp_path_factory):
    """The tiny llama with its most frequent greedy token as EOS (so EOS really ends
    requests, at different steps)."""
    llm = make_llm(tiny_model_dir("llama"), None)
    free = llm.generate(
        random_prompts(6, 4, 30, seed=5), SamplingParams(max_tokens=24, ignore_eos=True)
    )
    common = Counter(t for o in free for t in o["token_ids"]).most_common(1)[0][0]
    return write_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny-eos"), seed=0, eos_token_id=int(common)
    )


def scenarios(serial: LLM) -> dict[str, tuple[list, list[SamplingParams]]]:
    """Named (prompts, params) cases; stop ids and strings come from the serial outputs."""
    mixed = random_prompts(7, 2, 60, seed=1)
    free = serial.generate(mixed, SamplingParams(max_tokens=20, ignore_eos=True))
    stop_ids = [o["token_ids"][4] for o in free[:3]]
    stop_str = free[3]["text"][5:8] or "a"
    return {
        "max_tokens": (
            mixed,
            [SamplingParams(max_tokens=k, ignore_eos=True) for k in (1, 2, 9, 20, 3, 14, 7)],
        ),
        "eos": (mixed, [SamplingParams(max_tokens=24)] * len(mixed)),
        "stop_ids": (
            mixed[:4],
            [
                SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[t])
                for t in [*stop_ids, 1]
            ],
        ),
        "stop_strings": (
            mixed[3:5],
            [SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop_str])] * 2,
        ),
        "prefix_sharing": (
            shared_prefix_prompts(5, seed=2),
            [SamplingParams(max_tokens=10, ignore_eos=True, n=2)] * 5,
        ),
        "batch_of_one": (mixed[:1], [SamplingParams(max_tokens=12, ignore_eos=True)]),
        "sampled": (
            mixed[:4],
            [
                SamplingParams(
                    max_tokens=10,
                    temperature=0.9,
                    top_k=20,
                    seed=s,
                    ignore_eos=True,
                    min_tokens=3,
                    logprobs=2,
                )
                for s in range(4)
            ],
        ),
        "penalties": (
            mixed[:3],
            [SamplingParams(max_tokens=10, presence_penalty=0.5, repetition_penalty=1.2)] * 3,
        ),
    }


@pytest.mark.parametrize(
    "cfg, streams",
    [
        (dict(page_size=1), STREAMS),
        (dict(page_size=4, max_extend_tokens=16), ("slow:2",)),
        (dict(max_running_requests=3), ("thread",)),
    ],
    ids=["page1", "page4-chunked", "running3"],
)
def test_overlap_matches_serial_on_every_scenario(eos_model, cfg, streams):
    serial = make_llm(eos_model, None, **cfg)
    cases = scenarios(serial)
    want = {name: run(serial, *case) for name, case in cases.items()}
    assert any(r == "stop" for _, r in want["eos"]), "EOS never hit: the scenario is vacuous"
    assert any(r == "stop" for _, r in want["stop_strings"])
    for stream in streams:
        llm = make_llm(eos_model, stream, **cfg)
        got = {name: run(llm, *case) for name, case in cases.items()}
        for name in cases:
            assert got[name] == want[name], (stream, name)
        llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_overlap_matches_hf_greedy(arch, tiny_model_dir):
    path = tiny_model_dir(arch)
    prompts = random_prompts(5, 2, 70, seed=1)
    ref = hf_greedy(load_hf_model(path), prompts, 12)
    llm = make_llm(path, "slow:1", page_size=4, max_extend_tokens=32)
    got = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o["token_ids"] for o in got] == ref
    assert_kv_clean(llm)


# --------------------------------------------------------------------------- aborts in flight
class Watched:
    """A pipelined scheduler seen by the overlap loop: after every schedule and commit the
    scheduler's integrity holds (no page an unconfirmed step reads is free), and no step
    writes a KV location an earlier unconfirmed step reads (what a page freed too early and
    handed to a new request would do)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.reads: list[tuple[int, set[int]]] = []  # (step, kv locations) unconfirmed
        self.steps = 0

    def schedule_ahead(self):
        ahead = self.sched.schedule_ahead()
        if ahead is not None:
            writes = set(ahead.plan.out_loc.tolist())
            for step, locs in self.reads:
                clash = writes & locs
                assert not clash, (
                    f"step {ahead.step} writes {sorted(clash)[:4]} that "
                    f"unconfirmed step {step} reads"
                )
            self.reads.append((ahead.step, set(ahead.plan.kv_indices.tolist())))
        self.sched.check_integrity()
        return ahead

    def commit_oldest(self, tokens: Sequence[int]):
        out = self.sched.commit_oldest(tokens)
        assert self.reads.pop(0)[0] == out.step
        self.sched.check_integrity()
        self.steps += 1
        return out

    @property
    def num_inflight(self) -> int:
        return self.sched.num_inflight


def install(llm: LLM, sched, stream: str, engine=None, loop_sched=None) -> StepLoop:
    """`llm` on `sched`, stepped at depth 1 on `stream` through `loop_sched` (a wrapper of
    `sched`; default itself) and `engine`'s device steps (default its own)."""
    rt = llm.runtime
    rt.loop.close()
    device = DeviceStep(engine or llm.engine, llm.eos_token_ids, llm.config.max_running_requests)
    stepped = sched if loop_sched is None else loop_sched
    rt.loop = StepLoop(stepped, device, make_stream(stream, llm.engine.device), depth=1)
    rt.scheduler = sched
    rt.local = rt.plane = LocalPlane(sched, rt.loop, llm.engine.max_seq_len)
    return rt.loop


def watch(llm: LLM, stream: str) -> Watched:
    w = Watched(llm.scheduler)
    install(llm, llm.scheduler, stream, loop_sched=w)
    return w


def step_until(llm: LLM, commits: int, got: dict[int, list[int]]) -> None:
    """Step until the scheduler committed `commits` steps in all (or ran out of work)."""
    while llm.has_work() and llm.scheduler.stats.steps < commits:
        for o in llm.step():
            got[o.rid].append(o.token_id)


def abort_scenario(llm: LLM, abort_after: int) -> dict[int, list[int]]:
    """Two long requests on a pool and slot table that hold two; after `abort_after` commits
    the first is aborted (a step that reads its KV in flight) and a third arrives, which can
    only run in its slot and pages."""
    sched = llm.scheduler
    prompts = random_prompts(3, 20, 20, seed=4)
    p = SamplingParams(max_tokens=40, ignore_eos=True)
    a, b = (sched.add_request(x, p) for x in prompts[:2])
    got: dict[int, list[int]] = {a: [], b: []}
    step_until(llm, abort_after, got)
    free_before = sched.kv_usage()["free_pages"]
    assert sched.abort(a)
    if llm.runtime.depth:
        assert sched.kv_usage()["free_pages"] == free_before, (
            "KV integrity: the abort freed pages a step in flight reads"
        )
    c = sched.add_request(prompts[2], p)
    got[c] = []
    step_until(llm, 10**9, got)
    assert_kv_clean(llm)
    return got


@pytest.mark.parametrize("stream", ["thread", "slow:3"])
@pytest.mark.parametrize("abort_after", [1, 2, 5])
def test_abort_in_flight_never_frees_pages_a_step_reads(tiny_model_dir, stream, abort_after):
    want = abort_scenario(make_llm(tiny_model_dir("llama"), None, **TIGHT), abort_after)
    llm = make_llm(tiny_model_dir("llama"), stream, **TIGHT)
    got = abort_scenario(llm, abort_after)
    assert llm.runtime.loop.sched.steps > 40
    assert got == want
    assert len(got[max(got)]) == 40
    llm.close()


class EagerRelease(Scheduler):
    """The bug the watch exists for: an abort frees the pages with a step still in flight."""

    def finish(self, rid: int, reason: str) -> bool:
        req = self.requests.get(rid)
        if req is None or not req.inflight:
            return super().finish(rid, reason)
        inflight, req.inflight = req.inflight, 0
        done = super().finish(rid, reason)
        req.inflight = inflight
        return done


def test_the_watch_catches_pages_freed_under_an_inflight_step(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), "inline", **TIGHT)
    s = llm.scheduler
    eager = EagerRelease(
        num_pages=s.alloc.num_pages,
        page_size=4,
        max_seq_len=64,
        max_running_requests=2,
        max_extend_tokens=4096,
        cache_type="radix",
        eos_token_ids=sorted(llm.eos_token_ids),
    )
    install(llm, eager, "thread", loop_sched=Watched(eager))
    with pytest.raises(AssertionError, match="KV integrity|writes"):
        abort_scenario(llm, 2)
    llm.close()


class Failing:
    """An engine whose device step `fail_at` raises (in the stream's thread)."""

    def __init__(self, engine, fail_at: int) -> None:
        self.engine, self.fail_at, self.steps = engine, fail_at, 0
        self.device = engine.device

    def sample_on_device(self, *args):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("device lost")
        return self.engine.sample_on_device(*args)


@pytest.mark.parametrize("stream", ["inline", "slow:1"])
def test_a_failing_device_step_aborts_everything_and_returns_every_page(tiny_model_dir, stream):
    llm = make_llm(tiny_model_dir("llama"), None, sim_device="0,0", num_pages=128, page_size=4)
    prompts = random_prompts(4, 5, 30, seed=12)
    want = llm.generate(prompts, SamplingParams(max_tokens=9, ignore_eos=True))
    loop = install(llm, llm.scheduler, stream, Failing(llm.engine, fail_at=4))
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(prompts, SamplingParams(max_tokens=9, ignore_eos=True))
    assert_kv_clean(llm)
    assert llm.generate(prompts, SamplingParams(max_tokens=9, ignore_eos=True)) == want
    assert_kv_clean(llm)
    loop.close()


# --------------------------------------------------------------------------- property
@pytest.fixture(scope="module")
def sim_pair(tiny_model_dir):
    cfg = dict(
        sim_device="0,0",
        num_pages=96,
        max_seq_len_override=128,
        page_size=4,
        max_extend_tokens=24,
        max_running_requests=4,
    )
    serial = LLM(tiny_model_dir("llama"), overlap=False, **cfg)
    overlap = {s: make_llm(tiny_model_dir("llama"), s, **cfg) for s in ("thread", "slow:1")}
    yield serial, overlap
    for llm in overlap.values():
        llm.close()


def drive(llm: LLM, reqs, aborts: dict[int, int]) -> dict[int, list[int]]:
    """Add `reqs` ((prompt, params) by index), step until done; request i is aborted once it
    has `aborts[i]` tokens (in the overlap loop its next step is in flight by then)."""
    sched = llm.scheduler
    rid_of = {sched.add_request(p, sp): i for i, (p, sp) in enumerate(reqs)}
    got: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
    while llm.has_work():
        for o in llm.step():
            i = rid_of[o.rid]
            got[i].append(o.token_id)
            if o.finish_reason is None and aborts.get(i) == len(got[i]):
                assert sched.abort(o.rid)
    assert_kv_clean(llm)
    return got


request_st = st.tuples(
    st.lists(st.integers(3, 300), min_size=1, max_size=40),
    st.integers(1, 12),  # max_tokens
    st.booleans(),  # a stop token id among the first outputs
)


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    reqs=st.lists(request_st, min_size=1, max_size=7),
    shared=st.booleans(),
    aborts=st.dictionaries(st.integers(0, 6), st.integers(1, 8), max_size=3),
)
def test_property_overlap_equals_serial_on_the_sim_device(sim_pair, reqs, shared, aborts):
    serial, overlap = sim_pair
    stem = [7] * 16 if shared else []
    base = [(stem + p, SamplingParams(max_tokens=k, ignore_eos=True)) for p, k, _ in reqs]
    free = drive(serial, base, {})
    built = []
    for (p, sp), (_, _, stop), out in zip(base, reqs, free.values(), strict=True):
        if stop and len(out) > 2:
            sp = SamplingParams(
                max_tokens=sp.max_tokens, ignore_eos=True, stop_token_ids=[out[len(out) // 2]]
            )
        built.append((p, sp))
    aborts = {i: k for i, k in aborts.items() if i < len(built)}
    want = drive(serial, built, aborts)
    for i, k in aborts.items():
        assert len(want[i]) <= k
    for llm in overlap.values():
        assert drive(llm, built, aborts) == want


# --------------------------------------------------------------------------- the Rust core
@dataclass(eq=False)
class CoreReq:
    """What the overlap loop reads of a request the Rust core schedules."""

    rid: int
    params: SamplingParams
    generator: int
    input_ids: np.ndarray
    output_ids: list[int] = field(default_factory=list)


class CorePipelined:
    """`minisgl_cpu.SchedulerCore`'s pipelined mode (`schedule_ahead` / `commit_oldest` /
    `retire`) behind the overlap loop's interface. The Python wrapper of the Rust core (the
    `rust_hotpath` scheduler, `RustScheduler`) has no pipelined mode, so `LLM` runs it
    serially; this drives the core itself."""

    def __init__(self, **cfg) -> None:
        self.cfg = cfg
        self.c = extension().SchedulerCore(radix=True, eos_token_ids=[], **cfg)
        self.reqs: dict[int, CoreReq] = {}

    def add(self, rid: int, ids: list[int], p: SamplingParams) -> None:
        c = self.cfg
        prompt, cap = validate_request(ids, p, c["max_seq_len"], c["num_pages"], c["page_size"])
        self.c.add_request(
            rid, prompt, cap, p.max_tokens, p.ignore_eos, list(p.stop_token_ids or ())
        )
        self.reqs[rid] = CoreReq(rid, p, 0, prompt)

    def schedule_ahead(self):
        a = self.c.schedule_ahead()
        if a is None:
            return None
        _, is_prefill, _, sizes, flat, rids = a
        plan = FlatStep(bool(is_prefill), PlanLayout(*sizes), np.array(flat, np.int32)).plan()
        return SimpleNamespace(plan=plan, reqs=[self.reqs[r] for r in rids])

    def commit_oldest(self, tokens: Sequence[int]):
        _, codes, rids, _ = self.c.commit_oldest([int(t) for t in tokens])
        outs = [
            StepOutput(int(r), int(t), FINISH_REASONS[k])
            for r, t, k in zip(rids, tokens, codes, strict=True)
        ]
        for o in outs:
            if o.finish_reason != DROPPED:
                self.reqs[o.rid].output_ids.append(o.token_id)
        return SimpleNamespace(outputs=outs)

    @property
    def num_inflight(self) -> int:
        return self.c.num_inflight


def drive_loop(loop: StepLoop, add, retire, reqs, aborts) -> dict[int, list[int]]:
    for rid, (p, sp) in enumerate(reqs):
        add(rid, p, sp)
    got: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
    live = set(got)
    while live:
        done = loop.step()
        for o in [] if done is None else done.outputs:
            got[o.rid].append(o.token_id)
            if o.finish_reason is not None:
                live.discard(o.rid)
            elif aborts.get(o.rid) == len(got[o.rid]):
                assert retire(o.rid)
                live.discard(o.rid)
    loop.drain()
    return got


@pytest.mark.rust_ext
@pytest.mark.parametrize("stream", ["thread", "slow:1"])
def test_the_rust_core_pipelined_mode_drives_the_overlap_loop(tiny_model_dir, stream):
    cfg = dict(
        num_pages=96, page_size=4, max_seq_len=128, max_running_requests=4, max_extend_tokens=24
    )
    engine = LLM(
        tiny_model_dir("llama"),
        sim_device="0,0",
        overlap=False,
        max_seq_len_override=128,
        num_pages=96,
    ).engine
    stem = [7] * 16
    prompts = [stem + p for p in random_prompts(6, 1, 30, seed=21)]
    reqs = [
        (p, SamplingParams(max_tokens=3 + 2 * i, ignore_eos=True)) for i, p in enumerate(prompts)
    ]
    reqs[1] = (prompts[1], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[0]))
    aborts = {2: 3, 4: 1}
    py = Scheduler(**cfg, cache_type="radix", eos_token_ids=[])
    core = CorePipelined(**cfg)
    outs = []
    for sched, add, retire, check in (
        (
            py,
            lambda r, p, sp: py.add_request(p, sp, rid=r),
            lambda r: py.retire(r, True),
            py.check_integrity,
        ),
        (core, core.add, lambda r: core.c.retire(r, True), core.c.check_integrity),
    ):
        device = DeviceStep(engine, frozenset(), 4)
        loop = StepLoop(sched, device, make_stream(stream, engine.device), depth=1)
        outs.append(drive_loop(loop, add, retire, reqs, aborts))
        loop.close()
        check()
    assert outs[0] == outs[1]
    assert [len(outs[0][i]) for i in range(6)] == [3, 12, 3, 9, 1, 13]
    assert core.c.free_pages().size + core.c.evictable_size // 4 == 96
