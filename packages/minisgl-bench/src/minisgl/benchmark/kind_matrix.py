"""Per CPU kind, what its last sessions showed (issue 59 item 3): `worklog/kinds/<kind>.json`.

    python -m minisgl.benchmark.kind_matrix record --kind KIND [--suite-log LOG] \
        [--steps suite=0,start=1,...] [--source TEXT] [--dir worklog/kinds] BASELINE.json ...

One record per kind, an entry per commit, oldest first: when (UTC), where the entry came from
(`source`), the suite's outcome (the counts of pytest's final summary line and the node ids of
its FAILED / ERROR lines; None where the suite did not run), the speed ratios and values
(tok/s, start-up seconds) of the baseline records measured at that commit, the exit codes of
the session's steps. A second entry at a recorded commit is merged into it (a later run
without the suite keeps the suite's result). Paths are repository-relative; the record names
no machine or user. `tools/ci/cpu_kind_session.sh` runs `record` as its last step; the site
(`tools/site/sitegen/kinds.py`) shows the matrix and which kinds are stale.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
KINDS_DIR = Path("worklog") / "kinds"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SUMMARY = re.compile(
    r"^=*\s*(?P<counts>\d+ \w+(?:, \d+ \w+)*|no tests ran) in (?P<secs>\d+(?:\.\d+)?)s\b"
)
_COUNT = re.compile(r"(\d+) (\w+)")
_FIELDS = {"passed": "passed", "failed": "failed", "skipped": "skipped", "error": "errors",
           "errors": "errors", "xfailed": "xfailed", "xpassed": "xpassed"}  # fmt: skip
_NODE = re.compile(r"^(FAILED|ERROR) (\S+)")


@dataclass(frozen=True)
class SuiteResult:
    """The test suite's outcome: passed, failed (a failure or an error), no tests, or error
    (no summary line: the run ended before pytest's)."""

    outcome: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    xfailed: int = 0
    xpassed: int = 0
    duration_s: float | None = None
    failed_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Measured:
    """What one baseline record gives the matrix."""

    commit: str
    dirty: bool
    utc: str
    ratios: dict[str, float]
    values: dict[str, float]


@dataclass(frozen=True)
class Entry:
    """One session's results on a kind at one commit."""

    commit: str
    utc: str
    source: str
    suite: SuiteResult | None = None
    ratios: dict[str, float] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)
    baselines: tuple[str, ...] = ()
    steps: dict[str, int] = field(default_factory=dict)
    dirty: bool = False
    notes: str = ""


# --- the suite's log ------------------------------------------------------------------------


def parse_summary(line: str) -> SuiteResult | None:
    """pytest's final line ('5 failed, 1451 passed, 42 skipped in 1358.90s (0:22:38)', with or
    without its '=' rule and colours) as counts, or None for any other line."""
    m = _SUMMARY.match(_ANSI.sub("", line).strip())
    if m is None:
        return None
    counts = {name: 0 for name in set(_FIELDS.values())}
    for number, word in _COUNT.findall(m.group("counts")):
        if word in _FIELDS:
            counts[_FIELDS[word]] += int(number)
    if counts["failed"] or counts["errors"]:
        outcome = "failed"
    elif counts["passed"] or counts["xfailed"] or counts["xpassed"] or counts["skipped"]:
        outcome = "passed"
    else:
        outcome = "no tests"
    return SuiteResult(outcome=outcome, duration_s=float(m.group("secs")), **counts)


def parse_suite_log(text: str) -> SuiteResult:
    """The suite's result from its log, with the node ids of its FAILED / ERROR lines; outcome
    'error' where no summary line was printed. A whole `bash .ci/run` log (its `== tests`
    step): the README's test command's pytest passes (the suite, the isa_paths passes, the
    rust_ext tests) summed, the other steps' runs left out; any other log: its last summary."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    section = _ci_tests_step(lines)
    found = [s for ln in (section or lines) if (s := parse_summary(ln)) is not None]
    ids = tuple(dict.fromkeys(m.group(2) for ln in section or lines if (m := _NODE.match(ln))))
    if not found:
        return SuiteResult(outcome="error", failed_ids=ids)
    summary = _summed(found) if section else found[-1]
    return replace(summary, failed_ids=ids)


def _ci_tests_step(lines: list[str]) -> list[str] | None:
    """The lines of `.ci/run`'s tests step (from its `== tests` header to the next `== `
    header), None when the log has no such step."""
    start = next((i for i, ln in enumerate(lines) if ln.startswith("== tests")), None)
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("== ")), None)
    return lines[start + 1 : end]


def _summed(parts: list[SuiteResult]) -> SuiteResult:
    counts = {f: sum(getattr(p, f) for p in parts) for f in set(_FIELDS.values())}
    outcomes = {p.outcome for p in parts}
    outcome = next(o for o in ("failed", "passed", "no tests") if o in outcomes)
    return SuiteResult(outcome=outcome, duration_s=sum(p.duration_s for p in parts), **counts)


# --- baseline records -----------------------------------------------------------------------


def _numbers(data: Any) -> dict[str, float]:
    if not isinstance(data, dict):
        return {}
    return {
        str(k): float(v)
        for k, v in data.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


def from_baseline(data: dict[str, Any]) -> Measured:
    """A `cpu_speed` record's ratios and each arm's output tok/s; a `startup` record's median
    seconds (process and `LLM()`, cold and warm) and its ratio."""
    git = data.get("git") if isinstance(data.get("git"), dict) else {}
    kind = data.get("kind")
    ratios: dict[str, float] = {}
    values: dict[str, float] = {}
    if kind == "startup":
        summary = data.get("summary") if isinstance(data.get("summary"), dict) else {}
        for temp in ("cold", "warm"):
            for key, value in _numbers(summary.get(temp)).items():
                if key.endswith("_s"):
                    values[f"startup.{temp}.{key}"] = value
        ratios = {f"startup.{k}": v for k, v in _numbers(data.get("ratios")).items()}
    else:
        ratios = _numbers(data.get("ratios"))
        results = data.get("results") if isinstance(data.get("results"), dict) else {}
        for profile, arms in results.items():
            for arm, metrics in arms.items() if isinstance(arms, dict) else []:
                tok_s = metrics.get("output_tok_s") if isinstance(metrics, dict) else None
                if isinstance(tok_s, int | float):
                    values[f"{profile}.{arm}.output_tok_s"] = float(tok_s)
    return Measured(
        commit=str(git.get("commit") or ""),
        dirty=bool(git.get("dirty")),
        utc=_utc(str(data.get("created") or "")),
        ratios=ratios,
        values=values,
    )


def _utc(created: str) -> str:
    """'2026-11-29T01:38:26+0000' as '2026-11-29T01:38:26Z' (other forms unchanged)."""
    return created[:-5] + "Z" if created.endswith("+0000") else created


# --- the record -----------------------------------------------------------------------------


def entry_json(entry: Entry) -> dict[str, Any]:
    suite = entry.suite
    return {
        "commit": entry.commit,
        "utc": entry.utc,
        "source": entry.source,
        "suite": None
        if suite is None
        else {
            "outcome": suite.outcome,
            "passed": suite.passed,
            "failed": suite.failed,
            "skipped": suite.skipped,
            "errors": suite.errors,
            "xfailed": suite.xfailed,
            "xpassed": suite.xpassed,
            "duration_s": suite.duration_s,
            "failed_ids": list(suite.failed_ids),
        },
        "ratios": dict(sorted(entry.ratios.items())),
        "values": dict(sorted(entry.values.items())),
        "baselines": list(entry.baselines),
        "steps": dict(entry.steps),
        "dirty": entry.dirty,
        "notes": entry.notes,
    }


def entry_from_json(data: dict[str, Any]) -> Entry:
    suite = data.get("suite")
    return Entry(
        commit=str(data["commit"]),
        utc=str(data["utc"]),
        source=str(data["source"]),
        suite=None
        if suite is None
        else SuiteResult(
            outcome=str(suite["outcome"]),
            passed=int(suite.get("passed", 0)),
            failed=int(suite.get("failed", 0)),
            skipped=int(suite.get("skipped", 0)),
            errors=int(suite.get("errors", 0)),
            xfailed=int(suite.get("xfailed", 0)),
            xpassed=int(suite.get("xpassed", 0)),
            duration_s=suite.get("duration_s"),
            failed_ids=tuple(suite.get("failed_ids", ())),
        ),
        ratios=_numbers(data.get("ratios")),
        values=_numbers(data.get("values")),
        baselines=tuple(data.get("baselines", ())),
        steps={str(k): int(v) for k, v in (data.get("steps") or {}).items()},
        dirty=bool(data.get("dirty", False)),
        notes=str(data.get("notes", "")),
    )


def read_kind(path: str | Path) -> tuple[str, list[Entry]]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return str(data["kind"]), [entry_from_json(e) for e in data.get("entries", [])]


def write_kind(path: str | Path, kind: str, entries: list[Entry]) -> None:
    """The kind's record; refuses an absolute path in an entry (records are portable)."""
    for entry in entries:
        for name in entry.baselines:
            if Path(name).is_absolute():
                raise ValueError(f"{name}: a record names repository-relative paths only")
    data = {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "entries": [entry_json(e) for e in entries],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def merge(old: Entry, new: Entry) -> Entry:
    """`new` over `old` at the same commit: the suite only where `new` ran it."""
    return replace(
        new,
        suite=new.suite if new.suite is not None else old.suite,
        ratios={**old.ratios, **new.ratios},
        values={**old.values, **new.values},
        baselines=tuple(dict.fromkeys((*old.baselines, *new.baselines))),
        steps={**old.steps, **new.steps},
        dirty=old.dirty or new.dirty,
        notes="; ".join(n for n in dict.fromkeys((old.notes, new.notes)) if n),
    )


def add_entry(entries: list[Entry], new: Entry) -> list[Entry]:
    """The entries with `new` added (merged into an entry at its commit), oldest first."""
    out = [e for e in entries if e.commit != new.commit]
    old = next((e for e in entries if e.commit == new.commit), None)
    out.append(new if old is None else merge(old, new))
    return sorted(out, key=lambda e: e.utc)


def describe(suite: SuiteResult | None) -> str:
    """'failed (5 failed, 1451 passed, 42 skipped)', or 'not run'."""
    if suite is None:
        return "not run"
    counts = f"{suite.failed} failed, {suite.passed} passed, {suite.skipped} skipped"
    return f"{suite.outcome} ({counts}" + (f", {suite.errors} errors)" if suite.errors else ")")


# --- the session's step ---------------------------------------------------------------------


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.strip()


def _relative(path: Path, root: Path) -> str:
    resolved = path.resolve()
    try:
        return resolved.relative_to(root).as_posix()
    except ValueError:
        return path.name


def _parse_steps(items: str) -> dict[str, int]:
    steps: dict[str, int] = {}
    for item in filter(None, items.split(",")):
        name, sep, rc = item.partition("=")
        if not sep or not rc.lstrip("-").isdigit():
            raise SystemExit(f"--steps: '{item}' is not NAME=EXIT_CODE")
        steps[name] = int(rc)
    return steps


def record(args: argparse.Namespace) -> Entry:
    root = Path(_git("rev-parse", "--show-toplevel")).resolve()
    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    suite = None
    if args.suite_log:
        log = Path(args.suite_log)
        suite = parse_suite_log(log.read_text(errors="replace")) if log.is_file() else None
    ratios: dict[str, float] = {}
    values: dict[str, float] = {}
    used: list[str] = []
    for name in args.baselines:
        path = Path(name)
        if not path.is_file():  # an unmatched glob: the step did not write it
            continue
        measured = from_baseline(json.loads(path.read_text(encoding="utf-8")))
        if measured.commit != commit:
            print(f"{path}: measured at {measured.commit[:7] or '?'}, not HEAD: left out")
            continue
        ratios.update(measured.ratios)
        values.update(measured.values)
        dirty = dirty or measured.dirty
        used.append(_relative(path, root))
    entry = Entry(
        commit=commit,
        utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        source=args.source,
        suite=suite,
        ratios=ratios,
        values=values,
        baselines=tuple(used),
        steps=_parse_steps(args.steps),
        dirty=dirty,
    )
    path = root / args.dir / f"{args.kind}.json"
    entries = read_kind(path)[1] if path.is_file() else []
    write_kind(path, args.kind, add_entry(entries, entry))
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minisgl.benchmark.kind_matrix")
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="add this checkout's HEAD to the kind's record")
    rec.add_argument("--kind", required=True, help="cardgate.hardware.cpu_kind()")
    rec.add_argument("--suite-log", help="the suite's output (left out: the suite did not run)")
    rec.add_argument("--steps", default="", help="NAME=EXIT_CODE,... of the steps run")
    rec.add_argument("--source", default="tools/ci/cpu_kind_session.sh")
    rec.add_argument("--dir", default=str(KINDS_DIR), help="repository-relative folder")
    rec.add_argument("baselines", nargs="*", help="baseline records of this session")
    args = parser.parse_args(argv)
    entry = record(args)
    print(
        f"{args.kind} at {entry.commit[:7]}: suite {describe(entry.suite)}, "
        f"{len(entry.ratios)} ratios from {len(entry.baselines)} baseline records "
        f"-> {Path(args.dir) / (args.kind + '.json')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
