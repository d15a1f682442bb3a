"""What the site shows, read from the repository: cards, evidence runs and baselines.

The board comes from cardgate (`cardgate.board.board_json(root)`: per card `verified`,
`flags`, `last_gate`); what a row does not say is derived from the evidence files, and a done
card is never shown as verified unless cardgate said so.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cardgate.board import LANES, load_board
from cardgate.card import Card, Item

EVIDENCE_DIR = Path("worklog") / "evidence"
BASELINE_DIR = Path("worklog") / "baselines"
RESEARCH_DIR = Path("worklog") / "research"
SKIP_DIRS = frozenset({".git", ".nox", ".venv", "node_modules", "target", "site", "worklog"})


@dataclass(frozen=True)
class GateRow:
    """One benchmark gate of a run: a metric against its threshold."""

    metric: str
    check: str
    status: str
    value: float | None
    threshold: float | None
    margin_pct: float | None
    message: str


@dataclass(frozen=True)
class Run:
    """One evidence record `worklog/evidence/<card>/<UTC>-<sha>-<phase>/`."""

    card_id: str
    name: str
    path: str  # repository-relative directory
    phase: str
    outcome: str
    utc: str
    commit: str
    hardware: str
    gpu: str | None
    machine: str
    files: tuple[str, ...]
    items: tuple[dict[str, Any], ...]
    checks: tuple[dict[str, Any], ...]
    gates: tuple[GateRow, ...]
    metrics: dict[str, float]

    @property
    def machine_class(self) -> str:
        return self.gpu or "cpu"


@dataclass(frozen=True)
class LastGate:
    outcome: str
    utc: str
    commit: str
    evidence_dir: str
    phase: str


@dataclass
class CardView:
    card: Card
    lane: str
    counts: dict[str, int]  # items, bound, unbound, manual
    verified: bool | None
    flags: list[str]
    last_gate: LastGate | None
    runs: list[Run]
    static_tests: dict[str, list[str]] = field(default_factory=dict)  # item key -> test ids

    @property
    def id(self) -> str:
        return self.card.id


@dataclass(frozen=True)
class Baseline:
    """One recorded benchmark file of `worklog/baselines/` (JSON), with its plot if any."""

    name: str  # file stem
    path: str
    data: dict[str, Any]
    plot: str | None  # repository-relative PNG recorded beside it
    notes: str | None  # a same-stem .md file

    @property
    def kind(self) -> str:
        return str(self.data.get("kind") or self.data.get("benchmark") or "custom")

    @property
    def machine_class(self) -> str:
        machine = self.data.get("machine")
        gpu = machine.get("gpu") if isinstance(machine, dict) else None
        if isinstance(gpu, dict):
            return str(gpu.get("name") or "gpu")
        if isinstance(gpu, str) and gpu:
            return gpu
        return "cpu"


@dataclass
class Site:
    root: Path
    cards: list[CardView]
    errors: list[str]
    baselines: list[Baseline]
    history: list[HistoryPoint]
    research: list[Path]

    def card(self, card_id: str) -> CardView:
        return next(c for c in self.cards if c.id == card_id)

    def runs(self) -> list[Run]:
        return [run for card in self.cards for run in card.runs]


@dataclass(frozen=True)
class HistoryPoint:
    """One value of a headline metric at one commit on one machine class."""

    metric: str
    series: str  # the workload (e.g. "offline tiny-llama many-short") or the card
    machine_class: str
    utc: str
    commit: str
    value: float
    threshold: float | None
    source: str  # repository-relative file it came from


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _machine_text(manifest: dict[str, Any]) -> str:
    cpu = manifest.get("cpu_model") or "?"
    count = manifest.get("cpu_count")
    text = f"{cpu} ({count} cores)" if count else str(cpu)
    return f"{text}, {manifest.get('platform', '?')}, Python {manifest.get('python', '?')}"


def _utc_from_name(name: str) -> str:
    stamp = name.split("-", 1)[0]
    if len(stamp) >= 15 and stamp[8] == "T":
        return (
            f"{stamp[0:4]}-{stamp[4:6]}-{stamp[6:8]}T{stamp[9:11]}:{stamp[11:13]}:{stamp[13:15]}Z"
        )
    return ""


def load_runs(root: Path, card_id: str) -> list[Run]:
    """Every complete evidence record of a card (with a summary.json), oldest first."""
    base = root / EVIDENCE_DIR / card_id
    if not base.is_dir():
        return []
    runs = []
    for directory in sorted(p for p in base.iterdir() if p.is_dir()):
        summary = _read_json(directory / "summary.json")
        if not isinstance(summary, dict):
            continue
        manifest = _read_json(directory / "manifest.json") or {}
        metrics = _read_json(directory / "metrics.json") or {}
        gpu = manifest.get("gpu")
        gpu_name = (gpu.get("gpu_name") or gpu.get("name")) if isinstance(gpu, dict) else gpu
        gates = tuple(
            GateRow(
                metric=str(g.get("metric", "?")),
                check=str(g.get("check", "?")),
                status=str(g.get("status", "?")),
                value=g.get("value"),
                threshold=g.get("threshold"),
                margin_pct=g.get("margin_pct"),
                message=str(g.get("message", "")),
            )
            for g in summary.get("gates", [])
            if isinstance(g, dict)
        )
        values = metrics.get("metrics", {}) if isinstance(metrics, dict) else {}
        runs.append(
            Run(
                card_id=card_id,
                name=directory.name,
                path=directory.relative_to(root).as_posix(),
                phase=str(summary.get("phase") or manifest.get("phase") or "?"),
                outcome=str(summary.get("outcome", "?")),
                utc=str(
                    summary.get("started_utc")
                    or manifest.get("started_utc")
                    or _utc_from_name(directory.name)
                ),
                commit=str(summary.get("commit") or manifest.get("commit") or ""),
                hardware=str(manifest.get("hardware") or "cpu"),
                gpu=str(gpu_name) if gpu_name else None,
                machine=_machine_text(manifest),
                files=tuple(sorted(p.name for p in directory.iterdir() if p.is_file())),
                items=tuple(i for i in summary.get("items", []) if isinstance(i, dict)),
                checks=tuple(c for c in summary.get("checks", []) if isinstance(c, dict)),
                gates=gates,
                metrics={k: float(v) for k, v in values.items() if isinstance(v, int | float)},
            )
        )
    return runs


def _board_dict(root: Path) -> dict[str, Any]:
    """cardgate's board JSON (per card `verified`, `flags`, `last_gate`) as a dict."""
    import cardgate.board

    return cardgate.board.board_json(root)


def _last_gate(row: dict[str, Any], runs: list[Run]) -> LastGate | None:
    raw = row.get("last_gate")
    if isinstance(raw, dict):
        # the matching run fills what the record did not say (old records have no times)
        run = next(
            (r for r in runs if r.path == raw.get("evidence_dir")), runs[-1] if runs else None
        )
        return LastGate(
            outcome=str(raw.get("outcome") or "?"),
            utc=str(raw.get("utc") or (run.utc if run else "")),
            commit=str(raw.get("commit") or (run.commit if run else "")),
            evidence_dir=str(raw.get("evidence_dir") or ""),
            phase=str(raw.get("phase") or "?"),
        )
    if not runs:
        return None
    last = runs[-1]
    return LastGate(last.outcome, last.utc, last.commit, last.path, last.phase)


def _flags(row: dict[str, Any], lane: str, runs: list[Run]) -> tuple[bool | None, list[str]]:
    if "verified" in row:
        verified = row["verified"]
        flags = [str(f) for f in row.get("flags") or []]
        return (None if verified is None else bool(verified)), flags
    if lane != "done":
        return None, []
    flags = ["not verified: this cardgate reports no evidence verification"]
    if not runs:
        flags.append("no evidence record")
    elif runs[-1].outcome != "pass":
        flags.append(f"last gate run is {runs[-1].outcome}, not pass")
    return False, flags


def static_bindings(root: Path) -> dict[str, dict[str, list[str]]]:
    """card id -> item ref -> test ids (`path::function`) bound with `mark.card` (static scan)."""
    found: dict[str, dict[str, list[str]]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if not (name.startswith("test") and name.endswith(".py")):
                continue
            path = Path(dirpath) / name
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if "mark.card" not in source:
                continue
            rel = path.relative_to(root).as_posix()
            for card_id, ref, test in _bindings_in(source):
                test_id = f"{rel}::{test}" if test else rel
                tests = found.setdefault(card_id, {}).setdefault(ref, [])
                if test_id not in tests:
                    tests.append(test_id)
    return found


def _card_call(node: ast.expr) -> list[str] | None:
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if not (isinstance(func, ast.Attribute) and func.attr == "card"):
        return None
    args = [a.value for a in node.args if isinstance(a, ast.Constant)]
    if len(args) < 2 or not all(isinstance(a, str) for a in args):
        return None
    return args


def _bindings_in(source: str) -> list[tuple[str, str, str]]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out: list[tuple[str, str, str]] = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{node.name}"
                for deco in node.decorator_list:
                    if (args := _card_call(deco)) is not None:
                        out.extend((args[0], ref, name) for ref in args[1:])
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{name}::")
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
            ):
                values = node.value.elts if isinstance(node.value, ast.List) else [node.value]
                for value in values:
                    if (args := _card_call(value)) is not None:
                        out.extend((args[0], ref, "") for ref in args[1:])

    visit(tree.body, "")
    return out


def item_tests(card: Card, runs: list[Run], static: dict[str, list[str]]) -> dict[str, list[str]]:
    """item key -> bound test ids: the last run's collection, else the static scan."""
    tests: dict[str, list[str]] = {}
    for ref, ids in static.items():
        item = card.lookup(ref)
        if item is not None:
            tests.setdefault(item.key, []).extend(
                t for t in ids if t not in tests.get(item.key, [])
            )
    if runs:
        for entry in runs[-1].items:
            key = str(entry.get("key", ""))
            if entry.get("tests"):
                tests[key] = [str(t) for t in entry["tests"]]
    return tests


def load_cards(root: Path) -> tuple[list[CardView], list[str]]:
    board = load_board(root)
    data = _board_dict(root)
    rows = {str(r.get("id")): r for r in data.get("cards", []) if isinstance(r, dict)}
    bindings = static_bindings(root)
    views = []
    for lane in LANES:
        for card in board.lanes[lane]:
            row = rows.get(card.id, {})
            runs = load_runs(root, card.id)
            verified, flags = _flags(row, lane, runs)
            counts = {k: int(row.get(k) or 0) for k in ("items", "bound", "unbound", "manual")}
            view = CardView(
                card=card,
                lane=lane,
                counts=counts,
                verified=verified,
                flags=flags,
                last_gate=_last_gate(row, runs),
                runs=runs,
            )
            view.static_tests = item_tests(card, runs, bindings.get(card.id, {}))
            views.append(view)
    errors = [str(e) for e in data.get("errors", [])]
    return views, errors


def item_status(view: CardView, item: Item) -> str:
    """pass / fail / hold from the last gate run, else `checked` / `open` from the card."""
    if view.runs:
        for entry in view.runs[-1].items:
            if entry.get("key") == item.key:
                return str(entry.get("status", "?"))
    return "checked" if item.checked else "open"


def load_baselines(root: Path) -> list[Baseline]:
    base = root / BASELINE_DIR
    out = []
    for path in sorted(base.glob("*.json")) if base.is_dir() else []:
        data = _read_json(path)
        if not isinstance(data, dict):
            continue
        png = path.with_suffix(".png")
        md = path.with_suffix(".md")
        out.append(
            Baseline(
                name=path.stem,
                path=path.relative_to(root).as_posix(),
                data=data,
                plot=png.relative_to(root).as_posix() if png.is_file() else None,
                notes=md.read_text(encoding="utf-8") if md.is_file() else None,
            )
        )
    return out


def _git(root: Path, *args: str) -> str:
    try:
        done = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def _blobs(root: Path, specs: list[str]) -> list[str | None]:
    """The text of each `rev:path` in one `git cat-file --batch` (None: missing), not one
    `git show` a version (the site's baselines have ~300 versions)."""
    if not specs:
        return []
    try:
        done = subprocess.run(["git", "cat-file", "--batch"], cwd=root, capture_output=True,
                              input="".join(f"{s}\n" for s in specs).encode(), timeout=60,
                              check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return [None] * len(specs)
    out: list[str | None] = []
    data, at = done.stdout, 0
    for _ in specs:
        end = data.find(b"\n", at)
        if end < 0:
            out.append(None)
            continue
        header = data[at:end].split()
        if header[-1:] in ([b"missing"], [b"ambiguous"]):  # "<spec> missing": no content
            out.append(None)
            at = end + 1
            continue
        size = int(header[-1])  # "<sha> <type> <size>", then the content and a newline
        body = data[end + 1 : end + 1 + size]
        out.append(body.decode("utf-8", "replace") if header[1:2] == [b"blob"] else None)
        at = end + 1 + size + 1
    return out


def baseline_versions(root: Path, baseline: Baseline) -> list[tuple[str, str, dict[str, Any]]]:
    """(commit, ISO date, data) of every committed version of a baseline file, newest first,
    plus the working copy (commit "" when it is not committed as is)."""
    versions: list[tuple[str, str, dict[str, Any]]] = []
    log = [line.partition(" ") for line in
           _git(root, "log", "--format=%H %cI", "--", baseline.path).splitlines()]  # fmt: skip
    texts = _blobs(root, [f"{sha}:{baseline.path}" for sha, _, _ in log])
    for (sha, _, date), text in zip(log, texts, strict=True):
        try:
            data = json.loads(text) if text else None
        except ValueError:
            continue
        if isinstance(data, dict):
            versions.append((sha, date, data))
    if not versions or versions[0][2] != baseline.data:
        versions.insert(0, ("", "", baseline.data))
    return versions


def load_research(root: Path) -> list[Path]:
    base = root / RESEARCH_DIR
    return sorted(base.glob("*.md")) if base.is_dir() else []
