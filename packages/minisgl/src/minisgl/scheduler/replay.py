"""Golden trace replay: drive the Python reference scheduler (`Scheduler`, pipelined mode)
with the events of a decision trace the Rust core recorded, and compare every decision.

    python -m minisgl.scheduler.replay TRACE     # prints a JSON report; exit 1 on a mismatch

Trace format (version 1): JSON lines, one event per line, written by
`minisgl_cpu_core::SchedCore` (`enable_trace` / `take_trace`; `minisgl_cpu.SchedulerCore` in
Python). Only the pipelined API is recorded; the first line is the configuration.

- `{"ev": "config", "version": 1, "num_pages": int, "page_size": int, "max_seq_len": int,
  "max_running": int, "max_extend_tokens": int, "radix": bool, "eos_token_ids": [int]}`
- `{"ev": "add", "rid": int, "prompt": [int], "max_total_len": int, "max_tokens": int,
  "ignore_eos": bool, "stop_token_ids": [int]}`: a request was queued.
- `{"ev": "retire", "rid": int, "abort": bool, "found": bool}`: `retire(rid, abort)` and
  whether the rid was live.
- `{"ev": "schedule", "step": int, "prefill": bool, "admitted": int, "layout": [bs,
  num_tokens, num_kv, num_sample], "rids": [int], "plan": [int]}`: `schedule_ahead` made
  step `step`; `plan` is the flat int32 buffer laid out as `plan.PLAN_SEGMENTS` (decode
  inputs still in flight are -1), `rids` the request of each batch row. `{"ev": "schedule",
  "step": null}`: `schedule_ahead` had no row to run but requests were waiting (admission
  was tried: it ticks the cache clock); a call with nothing waiting and nothing to run
  changes nothing and is not recorded.
- `{"ev": "commit", "step": int, "tokens": [int], "codes": [int]}`: `commit_oldest` of step
  `step` with one token per sample row; `codes` per sample: 0 running, 1 stop, 2 length,
  3 dropped (`request.FINISH_REASONS`).

The replay checks, event by event: `max_total_len` of every add, `found` of every retire,
every schedule (`step`, `prefill`, `admitted`, `layout`, every plan segment by name, `rids`)
and every commit (`step`, `codes`), and the KV integrity after each event. It stops at the
first mismatch and names its line, step and segment.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minisgl.core import SamplingParams
from minisgl.scheduler.request import FINISH_REASONS
from minisgl.scheduler.scheduler import Scheduler
from minisgl.step.plan import FlatStep, PlanLayout

TRACE_VERSION = 1


class TraceError(ValueError):
    """The trace cannot be read (not JSON lines, unknown event, missing field...)."""


@dataclass(frozen=True)
class Mismatch:
    line: int  # 1-based line of the trace
    event: str
    step: int | None
    segment: str  # what differs: a plan segment name, "codes", "rids", "integrity"...
    expected: Any  # the trace's value
    got: Any  # the Python scheduler's value


@dataclass(frozen=True)
class ReplayReport:
    ok: bool
    events: int  # events replayed (the config line excluded; up to the mismatch)
    steps: int  # scheduled steps compared
    commits: int
    mismatches: int  # 0, or 1: the replay stops at the first
    mismatch: Mismatch | None

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _scheduler(cfg: dict[str, Any]) -> Scheduler:
    if cfg.get("version") != TRACE_VERSION:
        raise TraceError(f"trace version {cfg.get('version')!r}, expected {TRACE_VERSION}")
    return Scheduler(
        num_pages=cfg["num_pages"],
        page_size=cfg["page_size"],
        max_seq_len=cfg["max_seq_len"],
        max_running_requests=cfg["max_running"],
        max_extend_tokens=cfg["max_extend_tokens"],
        cache_type="radix" if cfg["radix"] else "naive",
        eos_token_ids=cfg["eos_token_ids"],
    )


def _short(v: Any) -> Any:
    return v if not isinstance(v, list) or len(v) <= 64 else [*v[:64], "..."]


class _Replayer:
    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        self.steps = 0
        self.commits = 0

    def event(self, ev: dict[str, Any]) -> tuple[str, int | None, Any, Any] | None:
        """Apply one event; `(segment, step, expected, got)` on a mismatch."""
        kind = ev["ev"]
        if kind == "add":
            p = SamplingParams(max_tokens=ev["max_tokens"], ignore_eos=ev["ignore_eos"],
                               stop_token_ids=ev["stop_token_ids"] or None)  # fmt: skip
            rid = self.s.add_request(ev["prompt"], p, rid=ev["rid"])
            got = self.s.requests[rid].max_total_len
            if got != ev["max_total_len"]:
                return "max_total_len", None, ev["max_total_len"], got
        elif kind == "retire":
            got = self.s.retire(ev["rid"], ev["abort"])
            if got != ev["found"]:
                return "found", None, ev["found"], got
        elif kind == "schedule":
            return self._schedule(ev)
        elif kind == "commit":
            self.commits += 1
            out = self.s.commit_oldest(ev["tokens"])
            if out.step != ev["step"]:
                return "step", ev["step"], ev["step"], out.step
            codes = [FINISH_REASONS.index(o.finish_reason) for o in out.outputs]
            if codes != ev["codes"]:
                return "codes", ev["step"], ev["codes"], codes
        else:
            raise TraceError(f"unknown event {kind!r}")
        return None

    def _schedule(self, ev: dict[str, Any]) -> tuple[str, int | None, Any, Any] | None:
        a = self.s.schedule_ahead()
        want = ev["step"]
        if want is None or a is None:
            return None if want is None and a is None else ("step", want, want, a and a.step)
        self.steps += 1
        flat = FlatStep.of(a.plan, a.batch_pos)
        layout = PlanLayout(*ev["layout"])
        for name, expected, got in (
            ("step", want, a.step),
            ("prefill", ev["prefill"], a.plan.is_prefill),
            ("admitted", ev["admitted"], a.admitted),
            ("layout", list(layout), list(flat.layout)),
        ):
            if expected != got:
                return name, want, expected, got
        data = np.asarray(ev["plan"], dtype=np.int64)
        if len(data) != layout.total:
            return "plan", want, f"{len(data)} values", f"{layout.total} values"
        for name, off, n in layout.segments():
            x, y = data[off : off + n].tolist(), flat.segment(name).tolist()
            if x != y:
                return name, want, _short(x), _short(y)
        rids = [r.rid for r in a.reqs]
        if rids != ev["rids"]:
            return "rids", want, ev["rids"], rids
        return None


def _events(path: Path) -> list[tuple[int, dict[str, Any]]]:
    out = []
    with path.open() as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{i}: not JSON ({e})") from None
            if not isinstance(ev, dict) or "ev" not in ev:
                raise TraceError(f"{path}:{i}: not a trace event")
            out.append((i, ev))
    if not out or out[0][1]["ev"] != "config":
        raise TraceError(f"{path}: the first event must be the config")
    return out


def replay_trace(path: str | Path) -> ReplayReport:
    """Replay a trace through the Python scheduler; the report names the first mismatch.
    Raises TraceError for a trace that cannot be read."""
    events = _events(Path(path))
    try:
        r = _Replayer(_scheduler(events[0][1]))
    except KeyError as e:
        raise TraceError(f"{path}:{events[0][0]}: config misses {e}") from None
    for n, (line, ev) in enumerate(events[1:], 1):
        step = ev.get("step")
        try:
            bad = r.event(ev)
            if bad is None:
                r.s.check_integrity()
        except KeyError as e:
            raise TraceError(f"{path}:{line}: {ev['ev']} event misses {e}") from None
        except AssertionError as e:
            bad = ("integrity", step, "intact", str(e))
        except (ValueError, RuntimeError) as e:  # the Python scheduler refused the event
            if isinstance(e, TraceError):
                raise TraceError(f"{path}:{line}: {e}") from None
            bad = ("error", step, "accepted", f"{type(e).__name__}: {e}")
        if bad is not None:
            segment, step, expected, got = bad
            mismatch = Mismatch(line, ev["ev"], step, segment, expected, got)
            return ReplayReport(False, n, r.steps, r.commits, 1, mismatch)
    return ReplayReport(True, len(events) - 1, r.steps, r.commits, 0, None)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: python -m minisgl.scheduler.replay TRACE", file=sys.stderr)
        return 2
    try:
        report = replay_trace(args[0])
    except (OSError, TraceError) as e:
        print(json.dumps({"ok": False, "error": str(e)}))
        return 2
    print(report.to_json())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
