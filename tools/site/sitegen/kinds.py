"""The CPU kind matrix (issue 59 item 3): per kind, from `worklog/kinds/<kind>.json` (written by
`python -m minisgl.benchmark.kind_matrix`, the last step of `tools/ci/cpu_kind_session.sh`),
its last suite run, its last green commit and how far behind HEAD it is, and the latest speed
ratios; a kind is stale when its last suite run did not pass, none is recorded, or its last
green commit is more than `MAX_BEHIND` commits behind HEAD."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sitegen.data import _git

KINDS_DIR = Path("worklog") / "kinds"
KINDS_PAGE = "worklog/kinds.md"
MAX_BEHIND = 50  # commits between a kind's last green commit and HEAD before it is stale
SINGLE_RATIO = "single.minisgl-default/llamacpp"
PEER_PREFIXES = {"vllm.": "vLLM", "llamacpp.": "llama.cpp"}  # values of peers measured alone


@dataclass(frozen=True)
class KindEntry:
    """One session's results on a kind at one commit (an entry of its record)."""

    commit: str
    utc: str
    source: str
    suite: dict[str, Any] | None
    ratios: dict[str, float]
    values: dict[str, float]
    notes: str

    @property
    def outcome(self) -> str | None:
        return None if self.suite is None else str(self.suite.get("outcome"))


@dataclass(frozen=True)
class KindRecord:
    kind: str
    path: str  # repository-relative
    entries: tuple[KindEntry, ...]  # oldest first


@dataclass(frozen=True)
class KindRow:
    """A kind's row of the matrix."""

    record: KindRecord
    last: KindEntry | None
    last_suite: KindEntry | None
    last_green: KindEntry | None
    behind: int | None  # commits from the last green commit to HEAD
    last_behind: int | None  # commits from the newest entry's commit to HEAD
    stale_reasons: tuple[str, ...]


def _floats(data: Any) -> dict[str, float]:
    if not isinstance(data, dict):
        return {}
    return {
        str(k): float(v)
        for k, v in data.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


def _entry(data: dict[str, Any]) -> KindEntry:
    suite = data.get("suite")
    return KindEntry(
        commit=str(data.get("commit") or ""),
        utc=str(data.get("utc") or ""),
        source=str(data.get("source") or ""),
        suite=suite if isinstance(suite, dict) else None,
        ratios=_floats(data.get("ratios")),
        values=_floats(data.get("values")),
        notes=str(data.get("notes") or ""),
    )


def load_kinds(root: Path) -> list[KindRecord]:
    out = []
    for path in sorted((root / KINDS_DIR).glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        entries = sorted((_entry(e) for e in data.get("entries", [])), key=lambda e: e.utc)
        out.append(
            KindRecord(
                kind=str(data.get("kind") or path.stem),
                path=path.relative_to(root).as_posix(),
                entries=tuple(entries),
            )
        )
    return out


def commits_behind(root: Path) -> Callable[[str], int | None]:
    """Commits reachable from HEAD and not from `commit` (None: not in this history)."""

    def behind(commit: str) -> int | None:
        count = _git(root, "rev-list", "--count", f"{commit}..HEAD").strip()
        return int(count) if count.isdigit() else None

    return behind


def stale_reasons(
    last_suite: KindEntry | None,
    last_green: KindEntry | None,
    behind: int | None,
    max_behind: int = MAX_BEHIND,
) -> tuple[str, ...]:
    """Why a kind's evidence is stale (empty: it is current)."""
    reasons = []
    if last_suite is None:
        return ("no suite run recorded",)
    suite = last_suite.suite or {}
    if last_suite.outcome != "passed":
        counts = f"{suite.get('failed', 0)} failed" + (
            f", {suite['errors']} errors" if suite.get("errors") else ""
        )
        reasons.append(
            f"last suite run failed ({counts})"
            if last_suite.outcome == "failed"
            else f"last suite run: {last_suite.outcome}"
        )
    if last_green is None:
        reasons.append("no green suite run recorded")
    elif behind is None:
        reasons.append("last green commit not in this checkout's history")
    elif behind > max_behind:
        reasons.append(f"last green commit {behind} commits behind HEAD")
    return tuple(reasons)


def kind_row(record: KindRecord, behind: Callable[[str], int | None]) -> KindRow:
    with_suite = [e for e in record.entries if e.suite is not None]
    green = [e for e in with_suite if e.outcome == "passed"]
    last_suite = with_suite[-1] if with_suite else None
    last_green = green[-1] if green else None
    last = record.entries[-1] if record.entries else None
    n = behind(last_green.commit) if last_green is not None else None
    return KindRow(
        record=record,
        last=last,
        last_suite=last_suite,
        last_green=last_green,
        behind=n,
        last_behind=behind(last.commit) if last is not None else None,
        stale_reasons=stale_reasons(last_suite, last_green, n),
    )


# --- markdown -------------------------------------------------------------------------------


def _short(commit: str) -> str:
    return f"`{commit[:7]}`" if commit else "-"


def _latest(row: KindRow, has: Callable[[KindEntry], bool]) -> KindEntry | None:
    return next((e for e in reversed(row.record.entries) if has(e)), None)


def _suite_cell(entry: KindEntry | None) -> str:
    if entry is None or entry.suite is None:
        return "not recorded"
    s = entry.suite
    icon = "✔" if entry.outcome == "passed" else "✘"
    counts = (
        f"{s.get('failed', 0)} failed, {s.get('passed', 0):,} passed, {s.get('skipped', 0)} skipped"
    )
    if s.get("errors"):
        counts += f", {s['errors']} errors"
    return f"{icon} {entry.outcome}: {counts} at {_short(entry.commit)} ({entry.utc[:10]})"


BATCHED_PEERS = ("/hf-", "/vllm")  # a batched ratio's peer: HF generate, vLLM's CPU build


def _single_cell(row: KindRow) -> str:
    entry = _latest(row, lambda e: SINGLE_RATIO in e.ratios)
    if entry is None:
        return "-"
    return f"{entry.ratios[SINGLE_RATIO]:.2f}x ({_short(entry.commit)})"


def _batched_cell(row: KindRow) -> str:
    """Per peer (HF, vLLM), the ratios of the newest entry that measured against it: a kind
    session that ran only one of them leaves the other's newest ratios on show."""
    cells = []
    for peer in BATCHED_PEERS:
        entry = _latest(row, lambda e, p=peer: any(p in k for k in e.ratios))
        if entry is None:
            continue
        by_profile: dict[str, list[str]] = {}
        for key, value in sorted(entry.ratios.items()):
            if peer not in key:
                continue
            profile, _, arms = key.partition(".")
            mine, _, other = arms.partition("/")
            label = mine.removeprefix("minisgl-") + ("" if other == "hf-bf16" else f" vs {other}")
            by_profile.setdefault(profile, []).append(f"{label} {value:.2f}x")
        parts = [f"{p}: {', '.join(v)}" for p, v in by_profile.items()]
        cells.append("; ".join(parts) + f" ({_short(entry.commit)})")
    return "; ".join(cells) if cells else "-"


def _peers_cell(row: KindRow) -> str:
    def peer_keys(entry: KindEntry) -> list[str]:
        return [k for k in entry.values if k.startswith(tuple(PEER_PREFIXES))]

    entry = _latest(row, lambda e: bool(peer_keys(e)))
    if entry is None:
        return "-"
    ranges: dict[str, list[float]] = {}
    for key in sorted(peer_keys(entry)):
        base = key.removesuffix(".low").removesuffix(".high")
        ranges.setdefault(base, []).append(entry.values[key])
    parts = []
    for base, values in ranges.items():
        prefix = next(p for p in PEER_PREFIXES if base.startswith(p))
        what = base.removeprefix(prefix).removesuffix(".output_tok_s")
        low, high = min(values), max(values)
        number = f"{low:.0f}" if low == high else f"{low:.0f}-{high:.0f}"
        parts.append(f"{PEER_PREFIXES[prefix]} {what} {number}")
    return ", ".join(parts) + f" tok/s ({_short(entry.commit)})"


def _startup_cell(row: KindRow) -> str:
    keys = ("startup.cold.process_s", "startup.warm.process_s")
    entry = _latest(row, lambda e: all(k in e.values for k in keys))
    if entry is None:
        return "-"
    cold, warm = (entry.values[k] for k in keys)
    return f"{cold:.1f} s / {warm:.1f} s ({_short(entry.commit)})"


def _behind_cell(row: KindRow) -> str:
    green = "-" if row.behind is None else str(row.behind)
    if row.last is None or (
        row.last_green is not None and row.last.commit == row.last_green.commit
    ):
        return green
    newest = "?" if row.last_behind is None else str(row.last_behind)
    return f"{green} (newest entry: {newest})"


def _status_cell(row: KindRow) -> str:
    if row.stale_reasons:
        return "✘ **stale**: " + "; ".join(row.stale_reasons)
    return "✔ current"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def matrix_table(rows: list[KindRow]) -> str:
    header = [
        "Kind",
        "Status",
        "Last suite run",
        "Last green commit",
        "Behind HEAD",
        "Single stream vs llama.cpp",
        "Batched vs HF bf16",
        "Peers alone",
        "Start-up cold / warm",
        "Record",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        name = Path(row.record.path).name
        cells = [
            f"`{row.record.kind}`",
            _status_cell(row),
            _suite_cell(row.last_suite),
            _short(row.last_green.commit) if row.last_green else "none recorded",
            _behind_cell(row),
            _single_cell(row),
            _batched_cell(row),
            _peers_cell(row),
            _startup_cell(row),
            f"[{name}](kinds/{name})",
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _entry_lines(entry: KindEntry, behind: int | None) -> list[str]:
    ahead = "" if behind is None else f", {behind} commits behind HEAD"
    out = [f"### {_short(entry.commit)} · {entry.utc}{ahead}\n", f"- Source: {entry.source}"]
    out.append(f"- Suite: {_suite_cell(entry)}")
    failed = (entry.suite or {}).get("failed_ids") or []
    out += [f"    - `{node}`" for node in failed]
    if entry.ratios:
        out.append(
            "- Ratios: " + ", ".join(f"`{k}` {v:.2f}x" for k, v in sorted(entry.ratios.items()))
        )
    if entry.values:
        out.append(
            "- Values: " + ", ".join(f"`{k}` {v:.1f}" for k, v in sorted(entry.values.items()))
        )
    if entry.notes:
        out.append(f"- Notes: {entry.notes}")
    return [*out, ""]


def kinds_markdown(rows: list[KindRow], behind: Callable[[str], int | None]) -> str:
    out = [
        "# CPU kinds\n",
        "The project's machines are drawn by chance from several x86 kinds "
        "(`cardgate.hardware.cpu_kind()`); a change can pass on its author's kind and fail on "
        "another. Each kind's record, `worklog/kinds/<kind>.json`, gets an entry per commit a "
        "session ran at (`tools/ci/cpu_kind_session.sh`, its last step: the suite's result, "
        "the speed ratios of the records it wrote) or that was seeded from earlier records "
        f"(each entry names its source). A kind is **stale** when its last suite run did not "
        f"pass, no suite run is recorded, or its last green commit is more than {MAX_BEHIND} "
        "commits behind HEAD. Ratios are output tok/s of minisgl's arm over the peer's, "
        "medians of interleaved repeats, each from the newest entry that has it (its commit "
        "in brackets); compare them within a kind only.\n",
    ]
    if not rows:
        out.append("No CPU kind has a record in `worklog/kinds/` yet.\n")
        return "\n".join(out)
    out.append(matrix_table(rows))
    for row in rows:
        out.append(f"## {row.record.kind}\n")
        for entry in reversed(row.record.entries):
            out += _entry_lines(entry, behind(entry.commit))
    return "\n".join(out)


def kinds_pages(root: Path) -> dict[str, str | bytes]:
    """The matrix page and the records it links to."""
    records = load_kinds(root)
    behind = commits_behind(root)
    rows = [kind_row(r, behind) for r in records]
    files: dict[str, str | bytes] = {KINDS_PAGE: kinds_markdown(rows, behind)}
    for record in records:
        files[record.path] = (root / record.path).read_bytes()
    return files
