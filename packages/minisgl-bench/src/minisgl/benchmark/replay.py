"""Deterministic workload replay through the real scheduler (no model, synthetic tokens).

    python -m minisgl.benchmark.replay --input W.json --output R.json \\
        --backend python|rust_service [--enable-priority]

`python` drives the reference `Scheduler`; `rust_service` runs `minisgl-cpu-service replay`
(the Rust core, `minisgl_cpu_core::replay`, decision for decision the same loop) and returns
its report. Both reports are identical except `backend` and `timing`; the golden fixtures
(`minisgl/benchmark/workloads/`) pin their fingerprints.

The loop, one scheduler step per tick (serial: schedule, synthesize tokens, commit):
1. when nothing is queued or running, the clock jumps to the next arrival (skipped ticks
   are idle and not recorded);
2. every request with `arrival_tick <= tick` is submitted, in (arrival_tick, file order);
   one the scheduler refuses (`validate_request`: it can never fit) is `rejected` with the
   scheduler's message;
3. `schedule()`; `queued`, `running` and `kv_pages` are read right after it (the state the
   step runs in); each sampled request gets `synthetic_token(id, its output count)`;
   `commit()`; a request finishes at its `output_len` (or the context cap `max_seq_len`).
A tick is recorded when a step ran (`kind` prefill / decode) or a request was rejected
(`kind` idle). `kv_pages` counts pages not reclaimable: `num_pages - free - evictable cached`.

Fingerprint: sha256 (hex) of the UTF-8 text `"minisgl-replay-trace/1\\n"` followed by one
line per tick record, `f"{tick} {kind} admitted={ids} prefill={n} decoded={ids}
finished={ids} rejected={ids} queued={n} running={n} kv={n}\\n"` with `ids` the request ids
joined by `,` in step order (`decoded`: requests that got an output token this tick, in
sample order; a prefill step samples the first token of every prompt it completes).

Summary (over step ticks; integer comparisons, so identical in both languages):
- peaks: max queued, running, kv_pages;
- pressure: `queue_slot_ticks` (queued > 0 and running == max_running), `queue_kv_ticks`
  (queued > 0, running < max_running, prefill tokens < budget: admission was refused for KV),
  `queue_budget_ticks` (the rest of queued > 0: the prefill budget was used up),
  `queue_ticks` = slot + kv, `kv_ticks` (10 * kv_pages >= 9 * num_pages, i.e. >= 90 %);
- utilisation: mean kv_pages / num_pages, mean running / max_running, prefill tokens /
  (prefill steps * budget);
- `pages_returned`: after the drain the scheduler's integrity check passes and every page is
  free or held by the prefix cache as evictable (no protected or request-owned page).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from minisgl.benchmark.workload import (
    Capacity,
    Workload,
    WorkloadError,
    WorkloadRequest,
    load_workload,
    synthetic_token,
)
from minisgl.core import SamplingParams
from minisgl.scheduler.request import RequestError
from minisgl.scheduler.scheduler import Scheduler

SCHEMA = "minisgl-replay/1"
TRACE_HEADER = "minisgl-replay-trace/1\n"
BACKENDS = ("python", "rust_service")
WORKLOADS_DIR = Path(__file__).with_name("workloads")
# report fields outside the comparison between backends
UNCOMPARED = ("backend", "timing")


class ReplayError(RuntimeError):
    """The replay could not run (the Rust binary failed, the scheduler stalled...)."""


@dataclass(frozen=True)
class TickRecord:
    tick: int
    kind: str  # "prefill" | "decode" | "idle"
    admitted: tuple[str, ...]
    prefill_tokens: int
    decoded: tuple[str, ...]
    finished: tuple[str, ...]
    rejected: tuple[str, ...]
    queued: int
    running: int
    kv_pages: int

    def canonical(self) -> str:
        return (
            f"{self.tick} {self.kind} admitted={','.join(self.admitted)} "
            f"prefill={self.prefill_tokens} decoded={','.join(self.decoded)} "
            f"finished={','.join(self.finished)} rejected={','.join(self.rejected)} "
            f"queued={self.queued} running={self.running} kv={self.kv_pages}\n"
        )

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("admitted", "decoded", "finished", "rejected"):
            d[k] = list(d[k])
        return d


def fingerprint(records: Sequence[TickRecord]) -> str:
    text = TRACE_HEADER + "".join(r.canonical() for r in records)
    return hashlib.sha256(text.encode()).hexdigest()


def records_of(report: dict[str, Any]) -> list[TickRecord]:
    """The tick records of a report (to recompute its fingerprint)."""
    return [TickRecord(**{k: tuple(v) if isinstance(v, list) else v for k, v in t.items()})
            for t in report["ticks"]]  # fmt: skip


def _kv_pages(s: Scheduler) -> int:
    return s.alloc.num_pages - s.alloc.num_free_pages - s.cache.evictable_size // s.page_size


def replay_python(w: Workload, *, enable_priority: bool = False) -> dict[str, Any]:
    """Replay `w` through the Python reference `Scheduler`; the report (module docs)."""
    t0 = time.perf_counter()
    c = w.capacity
    sched = Scheduler(
        num_pages=c.num_pages, page_size=c.page_size, max_seq_len=c.max_seq_len,
        max_running_requests=c.max_running, max_extend_tokens=c.prefill_budget,
        cache_type=c.cache, priority_aging_steps=c.priority_aging_steps if enable_priority
        else None,
    )  # fmt: skip
    run = _PythonReplay(w, sched)
    records = run.run()
    return build_report(
        w, "python", enable_priority, records, run.outcomes, sched.stats.prompt_tokens,
        sched.stats.cached_prompt_tokens, _drain(sched), time.perf_counter() - t0,
    )  # fmt: skip


class _PythonReplay:
    """The tick loop of `replay_python` over one scheduler (rid = index in the file)."""

    def __init__(self, w: Workload, sched: Scheduler) -> None:
        self.reqs = w.requests
        self.sched = sched
        self.ids = [r.id for r in w.requests]
        self.outcomes = [_outcome(r) for r in w.requests]

    def run(self) -> list[TickRecord]:
        reqs, sched = self.reqs, self.sched
        order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival_tick, i))
        records: list[TickRecord] = []
        tick = nxt = 0
        while nxt < len(order) or sched.has_work():
            if not sched.has_work() and reqs[order[nxt]].arrival_tick > tick:
                tick = reqs[order[nxt]].arrival_tick  # idle: jump to the next arrival
            due = nxt
            while nxt < len(order) and reqs[order[nxt]].arrival_tick <= tick:
                nxt += 1
            rejected = self.submit(order[due:nxt])
            record = self.step(tick, rejected)
            if record is not None:
                records.append(record)
            tick += 1
        return records

    def submit(self, idxs: Sequence[int]) -> tuple[str, ...]:
        """Queue the requests `idxs`; the ids of those the scheduler refuses."""
        rejected: list[str] = []
        for i in idxs:
            r = self.reqs[i]
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
            try:
                self.sched.add_request(r.prompt_ids, params, rid=i, priority=r.priority)
            except RequestError as e:
                rejected.append(r.id)
                self.outcomes[i].update(status="rejected", error=str(e))
        return tuple(rejected)

    def step(self, tick: int, rejected: tuple[str, ...]) -> TickRecord | None:
        """One scheduler step with synthetic tokens; its record (None: nothing happened)."""
        sched, ids, out = self.sched, self.ids, self.outcomes
        n_waiting = len(sched.waiting)
        step = sched.schedule()
        if step is None:
            if sched.has_work():
                raise ReplayError(f"tick {tick}: the scheduler has work but scheduled nothing")
            if not rejected:
                return None
            return TickRecord(tick, "idle", (), 0, (), (), rejected, 0, 0, _kv_pages(sched))
        plan, batch = step
        # admission appends to `running`; a balanced prefill step may leave the last
        # admitted out of its batch
        n_admitted = n_waiting - len(sched.waiting)
        admitted = sched.running[len(sched.running) - n_admitted :]
        for req in admitted:
            out[req.rid].update(admitted_tick=tick, cached_tokens=req.cached_tokens)
        queued, running, kv = len(sched.waiting), len(sched.running), _kv_pages(sched)
        rows = [batch[k] for k in plan.sample_rows.tolist()]
        tokens = [synthetic_token(ids[r.rid], len(r.output_ids)) for r in rows]
        outputs = sched.commit(batch, plan, tokens)
        for o in outputs:
            rec = out[o.rid]
            rec["output_tokens"] += 1
            if rec["first_token_tick"] is None:
                rec["first_token_tick"] = tick
            if o.finish_reason is not None:
                rec.update(status="finished", finished_tick=tick)
        return TickRecord(
            tick, "prefill" if plan.is_prefill else "decode",
            tuple(ids[r.rid] for r in admitted), int(plan.extend_lens.sum()) if plan.is_prefill
            else 0, tuple(ids[o.rid] for o in outputs),
            tuple(ids[o.rid] for o in outputs if o.finish_reason is not None), rejected,
            queued, running, kv,
        )  # fmt: skip


def _outcome(r: WorkloadRequest) -> dict[str, Any]:
    return {
        "id": r.id, "priority": r.priority, "arrival_tick": r.arrival_tick,
        "prompt_len": len(r.prompt_ids), "output_len": r.output_len, "status": "unserved",
        "error": None, "admitted_tick": None, "first_token_tick": None, "finished_tick": None,
        "cached_tokens": 0, "output_tokens": 0,
    }  # fmt: skip


def _drain(sched: Scheduler) -> dict[str, Any]:
    """Where the pages are once every request is done; `error` None when all came back."""
    ps = sched.page_size
    free, cached = sched.alloc.num_free_pages, sched.cache.evictable_size // ps
    error = None
    try:
        sched.check_integrity()
    except AssertionError as e:
        error = str(e)
    if error is None and free + cached != sched.alloc.num_pages:
        error = (
            f"{sched.alloc.num_pages - free - cached} of {sched.alloc.num_pages} pages neither "
            "free nor evictable after the drain"
        )
    return {"free_pages": free, "cached_pages": cached, "error": error}


def _ratio(a: int, b: int) -> float:
    return a / b if b else 0.0


def _totals(
    records: Sequence[TickRecord],
    steps: Sequence[TickRecord],
    requests: Sequence[dict[str, Any]],
    prompt_tokens: int,
    cached_prompt_tokens: int,
) -> dict[str, int]:
    """The report's `totals`: requests by outcome, tokens, and ticks by kind."""
    prefill_steps = sum(r.kind == "prefill" for r in steps)
    ticks = records[-1].tick + 1 if records else 0
    return {
        "requests": len(requests),
        "finished": sum(r["status"] == "finished" for r in requests),
        "rejected": sum(r["status"] == "rejected" for r in requests),
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached_prompt_tokens,
        "output_tokens": sum(len(r.decoded) for r in records),
        "ticks": ticks,
        "steps": len(steps),
        "prefill_steps": prefill_steps,
        "decode_steps": len(steps) - prefill_steps,
        "idle_ticks": ticks - len(steps),
    }


def _pressure(steps: Sequence[TickRecord], c: Capacity) -> dict[str, int]:
    """The report's `pressure`: step ticks with requests queued, by what held them back, and
    step ticks with the KV pool at least 90 % used."""
    queued = [r for r in steps if r.queued > 0]
    slot = sum(r.running == c.max_running for r in queued)
    kv_blocked = sum(r.running < c.max_running and r.prefill_tokens < c.prefill_budget
                     for r in queued)  # fmt: skip
    return {
        "queue_ticks": slot + kv_blocked,
        "queue_slot_ticks": slot,
        "queue_kv_ticks": kv_blocked,
        "queue_budget_ticks": len(queued) - slot - kv_blocked,
        "kv_ticks": sum(10 * r.kv_pages >= 9 * c.num_pages for r in steps),
    }


def _utilisation(steps: Sequence[TickRecord], c: Capacity) -> dict[str, float]:
    """The report's `utilisation`: mean KV pages, running requests and prefill tokens over
    the step ticks, each as a fraction of its capacity."""
    prefills = [r for r in steps if r.kind == "prefill"]
    return {
        "kv": _ratio(sum(r.kv_pages for r in steps), len(steps) * c.num_pages),
        "running": _ratio(sum(r.running for r in steps), len(steps) * c.max_running),
        "prefill_budget": _ratio(
            sum(r.prefill_tokens for r in prefills), len(prefills) * c.prefill_budget
        ),
    }


def build_report(
    w: Workload,
    backend: str,
    enable_priority: bool,
    records: Sequence[TickRecord],
    requests: Sequence[dict[str, Any]],
    prompt_tokens: int,
    cached_prompt_tokens: int,
    drain: dict[str, Any],
    wall_s: float,
) -> dict[str, Any]:
    """The replay's report (module docs), summed up from its tick records."""
    steps = [r for r in records if r.kind != "idle"]
    return {
        "schema": SCHEMA,
        "backend": backend,
        "workload": w.name,
        "enable_priority": enable_priority,
        "capacity": asdict(w.capacity),
        "fingerprint": fingerprint(records),
        "totals": _totals(records, steps, requests, prompt_tokens, cached_prompt_tokens),
        "peaks": {
            "queued": max((r.queued for r in records), default=0),
            "running": max((r.running for r in records), default=0),
            "kv_pages": max((r.kv_pages for r in records), default=0),
        },
        "pressure": _pressure(steps, w.capacity),
        "utilisation": _utilisation(steps, w.capacity),
        "pages_returned": drain["error"] is None,
        "drain": drain,
        "requests": list(requests),
        "ticks": [r.to_json() for r in records],
        "timing": {"wall_s": wall_s},
    }


def comparable(report: dict[str, Any]) -> dict[str, Any]:
    """The report without the fields that may differ between backends."""
    return {k: v for k, v in report.items() if k not in UNCOMPARED}


def replay_rust_service(path: str | Path, *, enable_priority: bool = False) -> dict[str, Any]:
    """Run `minisgl-cpu-service replay` on the workload file; its report. A workload the
    binary refuses raises `WorkloadError` with its message."""
    from minisgl.cpu_service import service_binary

    with tempfile.TemporaryDirectory(prefix="minisgl-replay-") as tmp:
        out = Path(tmp) / "report.json"
        cmd = [str(service_binary()), "replay", "--input", str(path), "--output", str(out)]
        if enable_priority:
            cmd.append("--enable-priority")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode == 2:
            raise WorkloadError(proc.stderr.strip().removeprefix("error: "))
        if proc.returncode != 0 or not out.is_file():
            raise ReplayError(
                f"{cmd[0]} replay exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}"
            )
        return json.loads(out.read_text())


def run_replay(
    path: str | Path, backend: str = "python", *, enable_priority: bool = False
) -> dict[str, Any]:
    """Replay the workload file `path` on `backend` (`python` or `rust_service`)."""
    if backend == "python":
        return replay_python(load_workload(path), enable_priority=enable_priority)
    if backend == "rust_service":
        return replay_rust_service(path, enable_priority=enable_priority)
    raise ValueError(f"unknown replay backend {backend!r} (expected one of {', '.join(BACKENDS)})")


def fixtures() -> dict[str, Path]:
    """The shipped golden workloads by name."""
    return {p.stem: p for p in sorted(WORKLOADS_DIR.glob("*.json")) if p.stem != "expected"}


def expected_fingerprints() -> dict[str, dict[str, str]]:
    """`{fixture: {"fifo" | "priority": fingerprint}}` (the golden values)."""
    return json.loads((WORKLOADS_DIR / "expected.json").read_text())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minisgl.benchmark.replay", description=(
        "Replay a workload through the scheduler, tick by tick, with synthetic tokens."))  # fmt: skip
    ap.add_argument("--input", required=True, help="workload JSON file")
    ap.add_argument("--output", required=True, help="report JSON file to write")
    ap.add_argument("--backend", choices=BACKENDS, default="python")
    ap.add_argument("--enable-priority", action="store_true",
                    help="priority scheduling (lower number first, with aging)")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        report = run_replay(args.input, args.backend, enable_priority=args.enable_priority)
    except WorkloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ReplayError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out = Path(args.output)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(out)
    except OSError as e:
        print(f"error: {out}: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"backend": report["backend"], "fingerprint": report["fingerprint"],
                      "totals": report["totals"], "pages_returned": report["pages_returned"]}))  # fmt: skip
    if not report["pages_returned"]:
        print(f"error: KV pages not returned: {report['drain']['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
