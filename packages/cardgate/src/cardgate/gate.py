"""The gate: `python -m cardgate gate ID [--phase red|green] [--dry-run]`.

1. The card must lint clean (exit 3 otherwise) and, for the green phase, every `Depends on`
   card must be in `done/` (hold otherwise).
2. pytest runs in a subprocess restricted to the tests bound to the card
   (`--cardgate-card ID`, xdist args pass through) and writes a JSON report.
3. Every item gets `pass`, `hold` (missing evidence) or `fail`; benchmark gates, parity, the
   red/green rule and the working tree add card-level checks. The worst status decides.
4. Evidence goes to `worklog/evidence/<ID>/<stamp>-<sha>-<phase>/` (not on `--dry-run`).
5. On `pass` only: tick boxes, append `## Validation`, set `Status: done`, `git mv` to done/.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from cardgate import __version__, edit, evidence, gitutil, hardware
from cardgate.board import KANBAN_DIR, Board, load_board
from cardgate.card import Card, Item
from cardgate.gates import GateFormatError, GateResult, GateSet, evaluate, load_gates
from cardgate.plugin import load_report

Verdict = Literal["pass", "hold", "fail"]
Phase = Literal["red", "green"]
EXIT_CODES: dict[str, int] = {"pass": 0, "fail": 1, "hold": 2, "error": 3}
_RANK: dict[str, int] = {"pass": 0, "hold": 1, "fail": 2}
GATES_DIR = Path("worklog") / "gates"
ENV_PREFIXES = ("MINISGL_", "CARDGATE_")


class GateUsageError(Exception):
    """Unknown card, lint errors, bad gates file: the gate cannot decide (exit 3)."""


@dataclass
class ItemVerdict:
    key: str
    text: str
    status: Verdict
    reason: str
    depth: int = 0
    phase: str | None = None
    tests: list[str] = field(default_factory=list)


@dataclass
class Check:
    name: str
    status: Verdict
    reason: str


@dataclass
class GateOutcome:
    card_id: str
    phase: Phase
    outcome: Verdict
    items: list[ItemVerdict]
    checks: list[Check]
    gates: list[GateResult]
    commit: str | None
    dirty: list[str]
    red_failures: dict[str, list[str]] = field(default_factory=dict)
    evidence_dir: str | None = None
    moved_to: str | None = None
    card_paths: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.outcome]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["gates"] = [g.to_dict() for g in self.gates]
        data["exit_code"] = self.exit_code
        return data


@dataclass
class GateOptions:
    card_id: str
    root: Path = field(default_factory=Path.cwd)
    phase: Phase = "green"
    dry_run: bool = False
    workers: str | None = None
    pytest_args: list[str] = field(default_factory=list)
    python: str = sys.executable


def worst(statuses: list[Verdict]) -> Verdict:
    return max(statuses, key=lambda s: _RANK[s], default="pass")


# --- test outcomes -------------------------------------------------------------------------


def node_outcomes(report: dict[str, Any], card_id: str) -> dict[str, dict[str, Any]]:
    """Per test: its bound keys of this card and a combined status with a reason."""
    nodes: dict[str, dict[str, Any]] = {}
    for rec in report.get("tests", []):
        node = nodes.setdefault(
            rec["nodeid"], {"keys": set(), "status": None, "reason": "", "phases": {}}
        )
        for binding in rec.get("items", []):
            bound_card, _, key = binding.partition("::")
            if bound_card == card_id:
                node["keys"].add(key)
        node["phases"][rec["when"]] = rec
    for nodeid, node in nodes.items():
        phases = node["phases"]
        failed = [p for p in phases.values() if p["outcome"] == "failed"]
        skipped = [p for p in phases.values() if p["outcome"] == "skipped"]
        call = phases.get("call")
        if failed:
            node["status"], node["reason"] = (
                "fail",
                f"{nodeid} {failed[0]['when']}: "
                + (failed[0].get("message") or "failed").strip().splitlines()[-1][:300],
            )
        elif skipped:
            what = "xfail" if skipped[0].get("wasxfail") else "skipped"
            msg = (skipped[0].get("message") or "").strip()
            node["status"], node["reason"] = "hold", f"{nodeid} {what}: {msg}"
        elif call is not None and call.get("wasxfail"):
            node["status"], node["reason"] = "hold", f"{nodeid} xpassed"
        elif call is not None and call["outcome"] == "passed":
            node["status"], node["reason"] = "pass", nodeid
        else:
            node["status"], node["reason"] = "hold", f"{nodeid}: no result"
    return nodes


def collect_metrics(report: dict[str, Any]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    values: dict[str, float] = {}
    records: list[dict[str, Any]] = []
    for rec in report.get("tests", []):
        for m in rec.get("metrics", []):
            records.append({**m, "nodeid": rec["nodeid"]})
            values[m["name"]] = float(m["value"])
    return values, records


# --- deciding ------------------------------------------------------------------------------


def _leaf_verdict(
    item: Item, tests: list[dict[str, Any]], phase: Phase
) -> tuple[Verdict, str] | None:
    if item.manual:
        if item.checked:
            return "pass", "manual item, ticked by a person"
        return "hold", "manual item: tick it by hand once done"
    if not tests:
        return None
    failed = [t for t in tests if t["status"] == "fail"]
    held = [t for t in tests if t["status"] == "hold"]
    held_reason = held[0]["reason"] if held else ""
    if held and "missing evidence" not in held_reason:
        held_reason += " (missing evidence)"
    if phase == "red":
        if held:
            return "hold", held_reason
        if failed:
            return "pass", f"red: {len(failed)}/{len(tests)} failing as expected"
        return "fail", f"not red: all {len(tests)} bound tests pass before the implementation"
    if failed:
        return "fail", failed[0]["reason"]
    if held:
        return "hold", held_reason
    return "pass", f"{len(tests)} passed"


def judge_items(
    card: Card,
    nodes: dict[str, dict[str, Any]],
    phase: Phase,
    only: set[str] | None = None,
) -> list[ItemVerdict]:
    """Verdicts for the card's items in card order (parents after their children are judged)."""
    by_key: dict[str, list[dict[str, Any]]] = {}
    for nodeid, node in nodes.items():
        for key in node["keys"]:
            by_key.setdefault(key, []).append({"nodeid": nodeid, **node})
    verdicts: dict[str, ItemVerdict] = {}

    def depth(item: Item) -> int:
        return 0 if item.parent is None else 1 + depth(card.items[item.parent])

    def judge(key: str) -> ItemVerdict:
        item = card.items[key]
        tests = by_key.get(key, [])
        own = _leaf_verdict(item, tests, phase)
        statuses: list[Verdict] = []
        reasons: list[str] = []
        if own is not None:
            statuses.append(own[0])
            reasons.append(own[1])
        children = [judge(child) for child in item.children if only is None or child in only]
        for child in children:
            verdicts[child.key] = child
        if children:
            bad = [c for c in children if c.status != "pass"]
            statuses.append(worst([c.status for c in children]))
            reasons.append(
                f"{len(children) - len(bad)}/{len(children)} children satisfied"
                + (f" ({bad[0].key}: {bad[0].status})" if bad else "")
            )
        if not statuses:
            statuses, reasons = ["hold"], ["unbound: no test is bound to this item"]
        return ItemVerdict(
            key=key,
            text=item.text,
            status=worst(statuses),
            reason="; ".join(reasons),
            depth=depth(item),
            phase=item.phase,
            tests=sorted(t["nodeid"] for t in tests),
        )

    for key, item in card.items.items():
        if item.parent is None and (only is None or key in only):
            verdicts[key] = judge(key)
    return [verdicts[k] for k in card.items if k in verdicts]


def red_records(root: Path, card_id: str, head: str | None) -> dict[str, list[str]]:
    """key -> ["<commit> <evidence dir>"...] for valid red records at strict ancestors of HEAD."""
    found: dict[str, list[str]] = {}
    if head is None:
        return found
    for record in evidence.records(root, card_id):
        summary = record.summary
        if record.phase != "red" or record.outcome != "pass" or summary.get("dirty"):
            continue
        commit = summary.get("commit") or ""
        if not gitutil.is_strict_ancestor(root, commit, head):
            continue
        for key in summary.get("red_failures", {}):
            found.setdefault(key, []).append(f"{commit[:10]} {record.path.name}")
    return found


def apply_red_rule(
    verdicts: list[ItemVerdict], card: Card, reds: dict[str, list[str]]
) -> list[ItemVerdict]:
    for verdict in verdicts:
        item = card.items[verdict.key]
        if item.phase != "red" or item.manual or item.children:
            continue
        if verdict.key in reds:
            verdict.reason += f"; red at {reds[verdict.key][-1]}"
        elif verdict.status == "pass":
            verdict.status = "hold"
            verdict.reason += "; no red record at an earlier commit (run --phase red first)"
    # parents of red leaves inherit the worst child again
    for verdict in reversed(verdicts):
        item = card.items[verdict.key]
        if item.children:
            kids = [v for v in verdicts if v.key in item.children]
            verdict.status = worst([verdict.status, *[k.status for k in kids]])
    return verdicts


def attribute_gates(
    verdicts: list[ItemVerdict], results: list[GateResult], metric_nodes: dict[str, set[str]]
) -> None:
    """A missed threshold fails the items bound to the test that recorded the metric."""
    for result in results:
        if result.status != "fail":
            continue
        nodes = metric_nodes.get(result.metric, set())
        for verdict in verdicts:
            if nodes.intersection(verdict.tests):
                verdict.status = "fail"
                verdict.reason += f"; gate: {result.message}"


# --- the run -------------------------------------------------------------------------------


def gate_files(root: Path, card: Card) -> list[Path]:
    if card.gates:
        return [root / p for p in card.gates]
    default = root / GATES_DIR / f"{card.id}.yaml"
    return [default] if default.exists() else []


def pytest_command(
    opts: GateOptions, card: Card, report_path: Path, items: list[str] | None
) -> list[str]:
    cmd = [opts.python, "-m", "pytest", "-p", "no:cacheprovider"]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        cmd += ["-p", "cardgate"] + (["-p", "xdist"] if opts.workers else [])
    cmd += [
        f"--rootdir={opts.root}",
        f"--cardgate-card={card.id}",
        f"--cardgate-report={report_path}",
        f"--cardgate-root={opts.root}",
    ]
    if items is not None:
        cmd.append(f"--cardgate-items={','.join(items)}")
    if opts.workers:
        cmd += ["-n", opts.workers]
    return cmd + list(opts.pytest_args) + card.tests


def manifest(
    root: Path, card: Card, opts: GateOptions, commit: str | None, dirty: list[str]
) -> dict[str, Any]:
    card_bytes = (root / card.path).read_bytes()
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    return {
        "cardgate": __version__,
        "card": card.id,
        "card_path": card.path,
        "card_sha256": hashlib.sha256(card_bytes).hexdigest(),
        "phase": opts.phase,
        "commit": commit,
        "dirty": bool(dirty),
        "dirty_files": dirty[:200],
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "pytest_args": [*(["-n", opts.workers] if opts.workers else []), *opts.pytest_args],
        "env": {k: v.replace(str(root), ".") for k, v in env.items()},
        **hardware.describe(),
    }


def run_gate(opts: GateOptions, out: Callable[[str], None] = print) -> GateOutcome:
    root = opts.root.resolve()
    opts.root = root
    board = load_board(root)
    card = board.cards.get(opts.card_id)
    if card is None:
        raise GateUsageError(f"unknown card {opts.card_id!r} (known: {', '.join(board.cards)})")
    lint = board.card_errors(card.id)
    if lint:
        raise GateUsageError("card does not lint clean:\n" + "\n".join(map(str, lint)))
    for test_path in card.tests:
        if not (root / test_path).exists():
            raise GateUsageError(f"{card.path}: 'Tests:' path {test_path!r} does not exist")
    try:
        gates = load_gates(*gate_files(root, card))
    except (GateFormatError, OSError) as exc:
        raise GateUsageError(f"gates: {exc}") from None
    red_keys = [item.key for item in card.red_items()]
    if opts.phase == "red" and not red_keys:
        raise GateUsageError(f"{card.id} has no Red items (## TDD Subtasks / 1. Red)")

    checks: list[Check] = [Check("lint", "pass", "card and board lint clean")]
    commit: str | None = None
    dirty: list[str] = []
    if gitutil.is_repo(root):
        commit = gitutil.head(root)
        dirty = gitutil.dirty_files(root)
        if commit is None:
            checks.append(Check("git", "hold", "no commit yet"))
        if dirty:
            shown = ", ".join(dirty[:5]) + (" ..." if len(dirty) > 5 else "")
            checks.append(Check("clean tree", "hold", f"dirty working tree: {shown}"))
        else:
            checks.append(Check("clean tree", "pass", "working tree clean"))
    else:
        checks.append(Check("git", "hold", "not a git repository: evidence needs a commit"))
    if opts.phase == "green":
        checks.extend(_dependency_checks(board, card))

    with tempfile.TemporaryDirectory(prefix="cardgate-") as tmp:
        report_path = Path(tmp) / "report.json"
        cmd = pytest_command(opts, card, report_path, red_keys if opts.phase == "red" else None)
        out(f"cardgate: {' '.join(cmd[1:])}")
        proc = subprocess.run(cmd, cwd=root)
        report = load_report(report_path) if report_path.exists() else None
    if report is None:
        report = {"tests": [], "collection_errors": [], "exitstatus": proc.returncode}
        checks.append(Check("pytest", "fail", f"pytest exited {proc.returncode} without report"))
    elif proc.returncode not in (0, 1, 5):
        checks.append(Check("pytest", "fail", f"pytest exited {proc.returncode}"))
    for err in report.get("collection_errors", []):
        msg = (err.get("message") or "").strip().splitlines()
        checks.append(
            Check("collection", "fail", f"{err['nodeid']}: {msg[-1] if msg else 'error'}")
        )

    nodes = node_outcomes(report, card.id)
    only = set(red_keys) if opts.phase == "red" else None
    verdicts = judge_items(card, nodes, opts.phase, only)
    values, metric_records = collect_metrics(report)
    hw = str(report.get("hardware") or hardware.hardware_key())
    results: list[GateResult] = []
    red_failures: dict[str, list[str]] = {}
    if opts.phase == "green":
        results = evaluate(gates, values, hw)
        checks.extend(_gate_checks(gates, results))
        metric_nodes: dict[str, set[str]] = {}
        for rec in metric_records:
            metric_nodes.setdefault(rec["name"], set()).add(rec["nodeid"])
        attribute_gates(verdicts, results, metric_nodes)
        apply_red_rule(verdicts, card, red_records(root, card.id, commit))
    else:
        for v in verdicts:
            failing = [t for t in v.tests if nodes[t]["status"] == "fail"]
            if failing and not card.items[v.key].children:
                red_failures[v.key] = failing

    outcome = worst([*(v.status for v in verdicts), *(c.status for c in checks)])
    result = GateOutcome(
        card_id=card.id,
        phase=opts.phase,
        outcome=outcome,
        items=verdicts,
        checks=checks,
        gates=results,
        commit=commit,
        dirty=dirty,
        red_failures=red_failures,
    )
    if not opts.dry_run:
        _write_evidence(root, card, opts, result, report, values, metric_records, hw)
        if outcome == "pass" and opts.phase == "green":
            _close_card(root, card, result)
    return result


def _dependency_checks(board: Board, card: Card) -> list[Check]:
    checks = []
    for dep in card.depends_on:
        lane = board.cards[dep].lane
        status: Verdict = "pass" if lane == "done" else "hold"
        checks.append(Check(f"depends on {dep}", status, f"{dep} is in {lane}/"))
    return checks


def _gate_checks(gates: GateSet, results: list[GateResult]) -> list[Check]:
    checks = []
    for r in results:
        if r.status == "n/a":
            continue
        status: Verdict = {"pass": "pass", "fail": "fail"}.get(r.status, "hold")  # type: ignore[assignment]
        checks.append(Check(f"gate {r.metric} {r.check}", status, r.message))
    if len(gates) and not any(r.applicable for r in results):
        checks.append(Check("gates", "hold", "no gate rule matches this hardware"))
    return checks


def _write_evidence(
    root: Path,
    card: Card,
    opts: GateOptions,
    result: GateOutcome,
    report: dict[str, Any],
    values: dict[str, float],
    metric_records: list[dict[str, Any]],
    hw: str,
) -> None:
    short = result.commit[:7] if result.commit else "nogit"
    record_dir = evidence.create_record_dir(root, card.id, short, opts.phase)
    result.evidence_dir = record_dir.relative_to(root).as_posix()
    evidence.write_json(
        record_dir / "manifest.json", manifest(root, card, opts, result.commit, result.dirty)
    )
    evidence.write_jsonl(
        record_dir / "report.jsonl",
        [{k: v for k, v in rec.items() if k != "metrics"} for rec in report.get("tests", [])],
    )
    evidence.write_json(
        record_dir / "metrics.json",
        {
            "hardware": hw,
            "metrics": values,
            "records": metric_records,
            "gates": [g.to_dict() for g in result.gates],
        },
    )
    summary = result.to_dict()
    summary["dirty"] = bool(result.dirty)
    evidence.write_json(record_dir / evidence.SUMMARY, summary)


def _close_card(root: Path, card: Card, result: GateOutcome) -> None:
    """Tick, validate, set Status: done, then `git mv` to done/ (all staged, nothing committed)."""
    source = root / card.path
    text = source.read_text(encoding="utf-8")
    to_tick = [card.items[v.key].line for v in result.items if not card.items[v.key].checked]
    text = edit.tick(text, to_tick)
    text = edit.set_status(text, card.field_lines.get("status"), "done")
    today = datetime.now(UTC).strftime("%Y-%m-%d")
    text = edit.append_validation(
        text,
        today,
        [
            f"Gate: pass (`python -m cardgate gate {card.id}`)",
            f"Commit: `{result.commit}`",
            f"Evidence: `{result.evidence_dir}/`",
        ],
    )
    target = card.path
    if card.lane != "done":
        target = f"{KANBAN_DIR}/done/{source.name}"
        (root / target).parent.mkdir(parents=True, exist_ok=True)
        gitutil.git(root, "mv", card.path, target)
    (root / target).write_text(text, encoding="utf-8")
    gitutil.git(root, "add", target)
    result.moved_to = target
    result.card_paths = [card.path, target] if target != card.path else [target]
