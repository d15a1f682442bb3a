"""The scheduler seam: one `SchedulerBackend` protocol, a plain factory with a registry, the
flat plan layout defined once in Python and once in Rust (and equal), and no import cycles
among the `minisgl.scheduler` modules."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import minisgl.scheduler
from minisgl.core import SamplingParams
from minisgl.scheduler import cpu_backend, factory
from minisgl.scheduler.backend import ScheduledReq, SchedulerBackend, SchedulerConfig
from minisgl.scheduler.factory import available_backends, make_scheduler, register_backend
from minisgl.scheduler.request import FINISH_REASONS, RequestError, validate_request
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.shadow import ShadowScheduler
from minisgl.step.plan import (
    PLAN_FIELDS,
    PLAN_SEGMENTS,
    FlatStep,
    PlanLayout,
    StepPlan,
    build_step_plan,
)
from minisgl.testing import rust_hotpath

CFG = SchedulerConfig(num_pages=64, page_size=4, max_seq_len=96, max_running_requests=4,
                      max_extend_tokens=24, cache_type="radix", eos_token_ids=(0,))  # fmt: skip
needs_ext = pytest.mark.rust_ext  # the root conftest registers rust_hotpath for these
SCHED_DIR = Path(minisgl.scheduler.__file__).parent
PACKAGE = "minisgl.scheduler"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in (cpu_backend.ENV_BACKEND, cpu_backend.ENV_SHADOW, cpu_backend.ENV_SHADOW_REPORT):
        monkeypatch.delenv(k, raising=False)
    cpu_backend.reset_stats()


def drive(s: SchedulerBackend) -> list[tuple]:
    for i in range(6):
        s.add_request([5, 6, 7, 8, *range(1, 2 + 3 * i)], SamplingParams(max_tokens=1 + i % 4))
    outs = []
    while s.has_work():
        step = s.schedule()
        assert step is not None
        assert all(isinstance(r, ScheduledReq) for r in step.reqs)
        toks = [3] * len(step.plan.sample_rows)
        outs += [(o.rid, o.token_id, o.finish_reason) for o in s.commit(step.reqs, step.plan, toks)]
    s.check_integrity()
    return outs


# ---------------------------------------------------------------------- protocol and factory
@pytest.mark.card("P1-011", "schedulerbackend-protocol-and-a-plain-factory-no-import-cycles")
@pytest.mark.parametrize(
    "backend,shadow,name",
    [("python", False, "python"),
     pytest.param("rust_hotpath", False, "rust_hotpath", marks=needs_ext),
     pytest.param("python", True, "python+shadow:rust_hotpath", marks=needs_ext),
     pytest.param("rust_hotpath", True, "rust_hotpath+shadow:python", marks=needs_ext)],
)  # fmt: skip
def test_every_backend_is_a_scheduler_backend(backend, shadow, name):
    s = make_scheduler(CFG, backend, shadow=shadow)
    assert isinstance(s, SchedulerBackend)
    assert isinstance(s, ShadowScheduler) == shadow and s.backend == name
    assert drive(s) == drive(make_scheduler(CFG, "python", shadow=False))
    assert s.kv_usage()["running"] == 0 and s.page_size == 4 and not s.requests


@pytest.mark.card("P1-011", "schedulerbackend-protocol-and-a-plain-factory-no-import-cycles")
def test_scheduler_constructor_is_plain(monkeypatch):
    """`Scheduler(...)` is the Python reference whatever the environment says."""
    monkeypatch.setenv(cpu_backend.ENV_BACKEND, "rust_hotpath")
    monkeypatch.setenv(cpu_backend.ENV_SHADOW, "1")
    s = Scheduler(num_pages=64, page_size=4, max_seq_len=96, max_running_requests=4,
                  max_extend_tokens=24, cache_type="radix")  # fmt: skip
    assert type(s) is Scheduler and s.backend == "python"


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        SchedulerConfig(num_pages=8, page_size=0, max_seq_len=8, max_running_requests=1,
                        max_extend_tokens=8)  # fmt: skip
    with pytest.raises(ValueError, match="unknown cache_type 'lru'"):
        SchedulerConfig(num_pages=8, page_size=1, max_seq_len=8, max_running_requests=1,
                        max_extend_tokens=8, cache_type="lru")  # fmt: skip
    assert SchedulerConfig(8, 1, 8, 1, 8, eos_token_ids=(3, 1, 3)).eos_token_ids == (1, 3)


class _Counting:
    """A registered backend: the reference with every schedule counted."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.inner = Scheduler(**vars(config))
        self.schedules = 0
        self.backend = "counting"

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def schedule(self):
        self.schedules += 1
        return self.inner.schedule()


@pytest.mark.card("P1-011", "schedulerbackend-protocol-and-a-plain-factory-no-import-cycles")
def test_registry(monkeypatch):
    # the runtime's registry, whatever tests registered in this process before
    monkeypatch.setattr(factory, "_registry", {"python": factory._registry["python"]})
    assert available_backends() == ("python",)
    register_backend("counting", _Counting)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("counting", _Counting)
    with pytest.raises(ValueError, match="not normalized"):
        register_backend("Counting", _Counting)
    monkeypatch.setenv(cpu_backend.ENV_BACKEND, "counting")
    s = make_scheduler(CFG)
    assert isinstance(s, _Counting) and s.backend == "counting"
    drive(s)
    assert s.schedules > 0
    monkeypatch.setenv(cpu_backend.ENV_BACKEND, "fortran")
    with pytest.raises(ValueError, match="MINISGL_CPU_BACKEND='fortran': expected one of "
                                         "python, counting in process, or rust_service"):  # fmt: skip
        make_scheduler(CFG)


def test_a_failing_registered_backend_falls_back_to_python(monkeypatch):
    def broken(config):
        raise RuntimeError("service not reachable")

    monkeypatch.setattr(factory, "_registry", dict(factory._registry))
    register_backend("broken", broken)
    s = make_scheduler(CFG, "broken", shadow=False)
    assert type(s) is Scheduler
    assert cpu_backend.stats()["fallback_reasons"] == {"init": 1}


@pytest.mark.card("P1-011", "schedulerbackend-protocol-and-a-plain-factory-no-import-cycles")
def test_llm_builds_its_scheduler_through_the_registry(monkeypatch, tiny_model_dir):
    """A backend registered by name serves `LLM` with no change to `LLM` or the engine."""
    from minisgl import LLM

    monkeypatch.setattr(factory, "_registry", dict(factory._registry))
    register_backend("counting", _Counting)
    monkeypatch.setenv(cpu_backend.ENV_BACKEND, "counting")
    llm = LLM(tiny_model_dir("llama"), num_pages=128, page_size=4, max_extend_tokens=32)
    assert isinstance(llm.scheduler, _Counting)
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0]["token_ids"]) == 3 and llm.scheduler.schedules >= 3


@pytest.mark.card("P1-011", "schedulerbackend-protocol-and-a-plain-factory-no-import-cycles")
def test_request_validation_lives_next_to_req():
    p = SamplingParams(max_tokens=4)
    ids, cap = validate_request([1, 2, 3], p, max_seq_len=16, num_pages=4, page_size=4)
    assert ids.dtype == np.int32 and ids.tolist() == [1, 2, 3] and cap == 7
    with pytest.raises(RequestError, match="prompt is empty"):
        validate_request([], p, 16, 4, 4)
    with pytest.raises(RequestError, match="the pool holds 4"):
        validate_request([1, 2, 3], p, 16, 1, 4)


# ---------------------------------------------------------------------- plan layout
def _plan(bs: int, prefill: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    width = 16
    pt = np.arange(4 * width, dtype=np.int32).reshape(4, width) * 3 + 1
    slots = rng.integers(0, 4, size=bs).astype(np.int32)
    starts = rng.integers(0, 8, size=bs).astype(np.int32)
    ext = rng.integers(1, 8, size=bs).astype(np.int32)
    mask = rng.integers(0, 2, size=bs).astype(bool)
    ids = np.arange(int(ext.sum()), dtype=np.int32)
    return build_step_plan(pt, slots, starts, ext, ids, mask, prefill)


@pytest.mark.card("P1-011", "step-plan-layout-exported-once-by-name-from-rust")
@pytest.mark.parametrize("bs", [0, 1, 5])
def test_flat_step_round_trip(bs):
    plan = _plan(bs, prefill=True, seed=bs)
    pos = np.arange(bs, dtype=np.int32)[::-1].copy()
    flat = FlatStep.of(plan, pos)
    assert flat.data.dtype == np.int32 and len(flat.data) == flat.layout.total
    assert flat.layout == PlanLayout.of(plan)
    back = flat.plan()
    assert back.is_prefill
    for name in PLAN_FIELDS:
        assert getattr(back, name).tolist() == getattr(plan, name).tolist(), name
        assert np.shares_memory(getattr(back, name), flat.data) or not len(getattr(back, name))
    assert flat.segment("batch_pos").tolist() == pos.tolist()
    with pytest.raises(ValueError, match="expected int32"):
        FlatStep(True, flat.layout, flat.data[:-1])
    with pytest.raises(ValueError, match="expected int32"):
        FlatStep(True, flat.layout, flat.data.astype(np.int64))


@pytest.mark.card("P1-011", "step-plan-layout-exported-once-by-name-from-rust")
def test_python_layout_is_defined_once():
    names = [n for n, _, _ in PLAN_SEGMENTS]
    assert len(set(names)) == len(names) and names[-1] == "batch_pos"
    assert tuple(names[:-1]) == PLAN_FIELDS
    assert tuple(f.name for f in dataclasses.fields(StepPlan))[1:] == PLAN_FIELDS
    segs = PlanLayout(3, 5, 7, 2).segments()
    assert all(a[1] + a[2] == b[1] for a, b in itertools.pairwise(segs))
    assert segs[-1][1] + segs[-1][2] == PlanLayout(3, 5, 7, 2).total == 4 * 3 + 1 + 15 + 7 + 4 + 3


@needs_ext
@pytest.mark.card("P1-011", "step-plan-layout-exported-once-by-name-from-rust")
@pytest.mark.parametrize("sizes", [(0, 0, 0, 0), (1, 1, 1, 1), (3, 5, 7, 2), (32, 32, 4096, 32)])
def test_rust_exported_layout_equals_python(sizes):
    import minisgl_cpu

    assert list(minisgl_cpu.PLAN_SEGMENT_NAMES) == [n for n, _, _ in PLAN_SEGMENTS]
    rust = tuple(tuple(s) for s in minisgl_cpu.plan_segments(*sizes))
    assert rust == PlanLayout(*sizes).segments()


@needs_ext
def test_rust_finish_codes_index_finish_reasons():
    import minisgl_cpu

    codes = (minisgl_cpu.FINISH_NONE, minisgl_cpu.FINISH_STOP, minisgl_cpu.FINISH_LENGTH)
    assert [FINISH_REASONS[c] for c in codes] == [None, "stop", "length"]


@needs_ext
def test_extension_with_another_layout_is_refused_and_python_serves(monkeypatch):
    import minisgl_cpu

    class Skewed:
        SchedulerCore = minisgl_cpu.SchedulerCore
        __version__ = "0.0-skewed"

        @staticmethod
        def plan_segments(bs, t, kv, ns):
            segs = minisgl_cpu.plan_segments(bs, t, kv, ns)
            return [segs[1], segs[0], *segs[2:]]  # two segments swapped

    monkeypatch.setattr(rust_hotpath, "extension", lambda: Skewed)
    with pytest.raises(RuntimeError, match="0.0-skewed lays step plans out as"):
        rust_hotpath.RustScheduler(**vars(CFG))
    s = make_scheduler(CFG, "rust_hotpath", shadow=False)
    assert type(s) is Scheduler
    assert cpu_backend.stats()["fallback_reasons"] == {"init": 1}


@needs_ext
def test_the_pyo3_scheduler_refuses_priority_scheduling():
    """The PyO3 binding has no priority queue: asked for one, it says so (a ValueError), on
    every way it is built; FIFO (None) builds."""
    with pytest.raises(ValueError, match="no priority scheduling"):
        rust_hotpath.RustScheduler(**vars(dataclasses.replace(CFG, priority_aging_steps=4)))
    assert rust_hotpath.RustScheduler(**vars(CFG)).page_size == CFG.page_size


# ---------------------------------------------------------------------- imports
def scheduler_modules() -> list[str]:
    return sorted(f"{PACKAGE}.{p.stem}" for p in SCHED_DIR.glob("*.py") if p.stem != "__init__")


def import_graph(sources: dict[str, str], package: str = PACKAGE) -> dict[str, set[str]]:
    """module -> the `package` modules it imports, anywhere in its body (a function-level
    import is an edge too: a lazy import does not make a cycle go away)."""
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for mod, src in sources.items():
        for node in ast.walk(ast.parse(src)):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[mod] |= {n for n in names if n in sources and n != mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n) :], n]
            if n not in state and (cyc := visit(n)):
                return cyc
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cyc := visit(m)):
            return cyc
    return None


def test_cycle_finder_sees_lazy_import_cycles():
    src = {
        "minisgl.scheduler.a": "from minisgl.scheduler import b\n",
        "minisgl.scheduler.b": "def f():\n    from minisgl.scheduler.a import x\n",
        "minisgl.scheduler.c": "import minisgl.scheduler.a\n",
    }
    g = import_graph(src)
    assert g["minisgl.scheduler.a"] == {"minisgl.scheduler.b"}
    assert find_cycle(g) == ["minisgl.scheduler.a", "minisgl.scheduler.b", "minisgl.scheduler.a"]
    del src["minisgl.scheduler.b"]
    assert find_cycle(import_graph(src)) is None


@pytest.mark.card("P1-011", "schedulerbackend-protocol-and-a-plain-factory-no-import-cycles")
def test_no_import_cycle_among_scheduler_modules():
    sources = {m: (SCHED_DIR / f"{m.rsplit('.', 1)[1]}.py").read_text()
               for m in scheduler_modules()}  # fmt: skip
    graph = import_graph(sources)
    assert graph[f"{PACKAGE}.factory"] >= {f"{PACKAGE}.scheduler", f"{PACKAGE}.shadow"}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


@pytest.mark.card("P1-011", "schedulerbackend-protocol-and-a-plain-factory-no-import-cycles")
def test_each_scheduler_module_imports_alone_in_a_fresh_interpreter():
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = {
        m: subprocess.Popen([sys.executable, "-c", f"import {m}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for m in scheduler_modules()
    }  # fmt: skip
    failed = {}
    for m, p in procs.items():
        out, _ = p.communicate(timeout=120)
        if p.returncode:
            failed[m] = out[-2000:]
    assert not failed, failed
    assert len(procs) >= 9
