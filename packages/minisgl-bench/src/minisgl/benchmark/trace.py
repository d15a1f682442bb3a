"""Where a streamed request's time to first token goes, from the server's trace files.

A server started with `MINISGL_TRACE_DIR=<dir>` (`minisgl.utils.trace`) has every process mark
the stages a request passes. `summarize(dir)` keeps, per request (a run's uid), the first time it passed
each stage of `STAGES` (the first token's way), drops requests that missed one (aborted, rejected,
the python backend only: the Rust service marks none) and returns the gaps between successive
stages; they add up to the server's own time to first token (`api.sent -> api.first`).

    python -m minisgl.benchmark.trace DIR [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STAGES = [
    "api.sent",  # the API server sent the request to its tokenizer worker
    "tok.recv",  # the tokenizer worker read it
    "tok.sent",  # ... tokenized it and sent it to the engine
    "eng.add",  # the engine worker queued it
    "eng.step",  # the step that produced its first token began
    "eng.out",  # that step ended; the token goes to the detokenizer
    "tok.out",  # the detokenizer read it
    "tok.detok",  # ... and sent the text to the API server
    "api.first",  # the API server's receiver handed the first chunk to the request
]
TOTAL = f"{STAGES[0]}->{STAGES[-1]}"


@dataclass(frozen=True)
class TraceReport:
    stages: list[str]
    timelines: dict[tuple[int, int], dict[str, float]]  # (run, uid) -> stage -> seconds
    gaps_ms: dict[str, list[float]]  # "a->b" (and TOTAL) -> one value a request, uid order
    runs: int  # servers (a launcher and its workers) traced into the folder

    @property
    def requests(self) -> int:
        return len(self.timelines)

    def to_json(self) -> dict[str, Any]:
        def row(v: list[float]) -> dict[str, float | int]:
            s = sorted(v)
            return {
                "n": len(s),
                "p50": statistics.median(s),
                "p90": s[min(len(s) - 1, int(0.9 * len(s)))],
                "mean": statistics.fmean(s),
                "max": s[-1],
            }

        return {
            "requests": self.requests,
            "runs": self.runs,
            "stages": self.stages,
            "gaps_ms": {k: row(v) for k, v in self.gaps_ms.items() if v},
        }


def read_rows(trace_dir: Path) -> dict[tuple[int, int], dict[str, float]]:
    """(run, uid) -> stage -> the first time the uid passed it, over every process's file
    (`trace-<run>-<pid>.jsonl`: a run is one server, whose uids restart at 1)."""
    first: dict[tuple[int, int], dict[str, float]] = {}
    for path in sorted(Path(trace_dir).glob("trace-*.jsonl")):
        run = int(path.stem.split("-")[1])
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            stage, uid, t = json.loads(line)
            seen = first.setdefault((run, int(uid)), {})
            if stage not in seen or t < seen[stage]:
                seen[stage] = float(t)
    return first


def summarize(trace_dir: Path, stages: list[str] = STAGES) -> TraceReport:
    rows = read_rows(trace_dir)
    timelines = {
        uid: {s: seen[s] for s in stages}
        for uid, seen in sorted(rows.items())
        if all(s in seen for s in stages)
    }
    pairs = [f"{a}->{b}" for a, b in itertools.pairwise(stages)]
    gaps: dict[str, list[float]] = {k: [] for k in (*pairs, f"{stages[0]}->{stages[-1]}")}
    for times in timelines.values():
        for key, (a, b) in zip(pairs, itertools.pairwise(stages), strict=True):
            gaps[key].append((times[b] - times[a]) * 1e3)
        gaps[f"{stages[0]}->{stages[-1]}"].append((times[stages[-1]] - times[stages[0]]) * 1e3)
    return TraceReport(
        stages=list(stages),
        timelines=timelines,
        gaps_ms=gaps,
        runs=len({run for run, _ in rows}),
    )


def format_report(report: TraceReport) -> str:
    lines = [f"{report.requests} requests traced (first token's way, ms)"]
    for key, row in report.to_json()["gaps_ms"].items():
        lines.append(
            f"  {key:24s} p50 {row['p50']:8.3f}  p90 {row['p90']:8.3f}  max {row['max']:8.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minisgl.benchmark.trace", description=__doc__)
    p.add_argument("trace_dir", type=Path)
    p.add_argument("--json", type=Path, default=None, help="write the summary as JSON")
    args = p.parse_args(argv)
    report = summarize(args.trace_dir)
    if not report.requests:
        print(f"no complete request timeline under {args.trace_dir}", file=sys.stderr)
        return 1
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
