"""Gate stage 1: everything decided before pytest runs (lint, git state, dependencies, lock).

Usage errors (exit 3) are raised as `GateUsageError` before anything is written: an unknown
card, the card's own lint errors, a missing `Tests:`/`Gates:` path or one outside the
repository, an option in `Tests:` (paths only), a bad gates file, a file of the same name
already in `done/`, another gate holding the card's lock, `--phase red` without Red items,
pytest arguments but `-n`, `-v`, `-q` (and `-k` on a dry run), a `--timeout` above the card's `Timeout:`, and
`CARDGATE_GPU=1` where no driver shows a GPU. Other cards' lint errors and unverified dependencies hold the gate (checks).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cardgate import gitutil, hardware
from cardgate.board import KANBAN_DIR, Board, load_board
from cardgate.card import Card
from cardgate.outcome import Check, GateUsageError, Phase, Verdict
from cardgate.thresholds import GateFormatError, GateSet, load_gates
from cardgate.verify import verify_card

GATES_DIR = Path("worklog") / "gates"
WORKERS_RE = re.compile(r"\d+|auto|logical")


@dataclass(frozen=True)
class GateOptions:
    card_id: str
    root: Path = field(default_factory=Path.cwd)
    phase: Phase = Phase.GREEN
    dry_run: bool = False
    commit: bool = False
    workers: str | None = None
    timeout: float | None = None
    run_limit: float | None = None  # seconds for the whole pytest run (default: run.run_limit)
    pytest_args: tuple[str, ...] = ()
    python: str = ""
    allow_changed_tests: bool = False
    # the working tree the interpreter's editable installs point at (default: root); the room's
    # imports are redirected from it (`verify --rerun` gates a clone and keeps the original's)
    source: Path | None = None


@dataclass(frozen=True)
class Preflight:
    root: Path
    board: Board
    card: Card
    gates: GateSet
    red_keys: tuple[str, ...]
    commit: str | None
    dirty: tuple[str, ...]
    checks: tuple[Check, ...]
    timeout: float | None
    allow_changed_tests: bool = False
    run_limit: float | None = None


def gate_files(root: Path, card: Card) -> list[Path]:
    if card.gates:
        return [root / p for p in card.gates]
    default = root / GATES_DIR / f"{card.id}.yaml"
    return [default] if default.exists() else []


@contextlib.contextmanager
def card_lock(root: Path, card_id: str) -> Iterator[None]:
    """One gate per card at a time (released by the OS if the gate dies)."""
    base = gitutil.git_dir(root) if gitutil.is_repo(root) else None
    if base is None:
        tag = hashlib.sha256(str(root).encode()).hexdigest()[:12]
        base = Path(tempfile.gettempdir()) / f"cardgate-{tag}"
        base.mkdir(exist_ok=True)
    path = base / f"cardgate-{re.sub(r'[^A-Za-z0-9-]', '_', card_id)}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GateUsageError(
                f"another gate is running on {card_id} (lock {path}); wait for it to finish"
            ) from None
        yield
    finally:
        os.close(fd)


def _refuse(arg: str, why: str = "") -> GateUsageError:
    return GateUsageError(
        f"pytest argument {arg!r} is not allowed{why}: the gate runs the committed "
        f"configuration; allowed: -n N, -v, -q, and -k EXPR on --dry-run"
    )


def check_pytest_args(args: tuple[str, ...], dry_run: bool) -> None:
    """Only `-n N`, `-v`, `-q` and (on a dry run, which records nothing) `-k EXPR`: anything
    else would let the caller change the committed configuration (`-p`, `-o`, `-c`,
    `--rootdir`, `--confcutdir`, `--cardgate-*`, paths, `--deselect`, `-m`...)."""
    i = 0
    while i < len(args):
        arg = args[i]
        value: str | None
        if arg in ("-v", "-vv", "-q", "-qq"):
            i += 1
            continue
        if arg in ("-n", "--numprocesses", "-k"):
            option, value = arg, args[i + 1] if i + 1 < len(args) else None
            i += 2
        elif arg.startswith("--numprocesses=") or (arg[:2] in ("-n", "-k") and len(arg) > 2):
            option = "-k" if arg.startswith("-k") else "-n"
            value = arg.split("=", 1)[1] if arg.startswith("--") else arg[2:]
            i += 1
        else:
            raise _refuse(arg)
        if value is None:
            raise _refuse(arg, " without a value")
        if option != "-k" and not WORKERS_RE.fullmatch(value):
            raise _refuse(f"{arg} {value}", " (workers: a number, auto or logical)")
        if option == "-k" and not dry_run:
            raise _refuse(f"-k {value}", " on a recorded gate (it narrows the run; --dry-run)")


def _inside(root: Path, card: Card, header: str, paths: list[str]) -> None:
    for raw in paths:
        if raw.startswith("-"):
            raise GateUsageError(
                f"{card.path}: '{header}:' holds paths only, not the option {raw!r}: pytest "
                "options come from the committed configuration"
            )
        full = (root / raw).resolve()
        if not full.is_relative_to(root):
            raise GateUsageError(
                f"{card.path}: '{header}:' path {raw!r} is outside the repository: the "
                "commit would not hold it"
            )


def preflight(opts: GateOptions) -> Preflight:
    root = opts.root.resolve()
    check_pytest_args(opts.pytest_args, opts.dry_run)
    forced = hardware.forced_gpu_problem()
    if forced:
        raise GateUsageError(forced)
    board = load_board(root)
    card = board.cards.get(opts.card_id)
    if card is None:
        raise GateUsageError(f"unknown card {opts.card_id!r} (known: {', '.join(board.cards)})")
    _inside(root, card, "Tests", card.tests)
    _inside(root, card, "Gates", card.gates)
    lint = board.card_errors(card.id)
    if lint:
        raise GateUsageError("card does not lint clean:\n" + "\n".join(map(str, lint)))
    if opts.timeout and card.timeout and opts.timeout > card.timeout:
        raise GateUsageError(
            f"--timeout {opts.timeout:g} would raise the card's Timeout: {card.timeout:g}: "
            "only a lower one is allowed"
        )
    for test_path in card.tests:
        full = (root / test_path).resolve()
        if not full.exists():
            raise GateUsageError(f"{card.path}: 'Tests:' path {test_path!r} does not exist")
    target = root / KANBAN_DIR / "done" / Path(card.path).name
    if card.lane != "done" and target.exists():
        raise GateUsageError(
            f"{target.relative_to(root).as_posix()} already exists: the card cannot move there"
        )
    try:
        gates = load_gates(*gate_files(root, card), root=root)
    except (GateFormatError, OSError) as exc:
        raise GateUsageError(f"gates: {exc}") from None
    red_keys = tuple(item.key for item in card.red_items())
    if opts.phase is Phase.RED and not red_keys:
        raise GateUsageError(f"{card.id} has no Red items (## TDD Subtasks / 1. Red)")

    checks = [_board_check(board, card)]
    commit: str | None = None
    dirty: list[str] = []
    if gitutil.is_repo(root):
        commit = gitutil.head(root)
        dirty = gitutil.dirty_files(root)
        if commit is None:
            checks.append(Check("git", Verdict.HOLD, "no commit yet"))
        if dirty:
            shown = ", ".join(dirty[:5]) + (" ..." if len(dirty) > 5 else "")
            checks.append(Check("clean tree", Verdict.HOLD, f"dirty working tree: {shown}"))
        else:
            checks.append(Check("clean tree", Verdict.PASS, "working tree clean"))
    else:
        checks.append(Check("git", Verdict.HOLD, "not a git repository: evidence needs a commit"))
    if opts.phase is Phase.GREEN:
        checks.extend(_dependency_checks(root, board, card))
    if not card.items:
        checks.append(Check("items", Verdict.HOLD, "card has no items: nothing to prove"))
    return Preflight(
        root=root,
        board=board,
        card=card,
        gates=gates,
        red_keys=red_keys,
        commit=commit,
        dirty=tuple(dirty),
        checks=tuple(checks),
        timeout=opts.timeout or card.timeout,
        allow_changed_tests=opts.allow_changed_tests,
        run_limit=opts.run_limit,
    )


def _board_check(board: Board, card: Card) -> Check:
    others = [e for e in board.errors if e.path != card.path]
    if not others:
        return Check("lint", Verdict.PASS, "card and board lint clean")
    shown = "; ".join(map(str, others[:3])) + (" ..." if len(others) > 3 else "")
    return Check("board lint", Verdict.HOLD, f"{len(others)} board lint errors: {shown}")


def _dependency_checks(root: Path, board: Board, card: Card) -> list[Check]:
    checks = []
    for dep_id in card.depends_on:
        dep = board.cards[dep_id]
        if dep.lane != "done":
            checks.append(
                Check(f"depends on {dep_id}", Verdict.HOLD, f"{dep_id} is in {dep.lane}/")
            )
            continue
        verification = verify_card(root, dep)
        if verification.verified:
            checks.append(
                Check(f"depends on {dep_id}", Verdict.PASS, f"{dep_id} is done (verified)")
            )
        else:
            why = "; ".join(verification.flags)
            checks.append(Check(f"depends on {dep_id}", Verdict.HOLD, f"{dep_id}: {why}"))
    return checks
