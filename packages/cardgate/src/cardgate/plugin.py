"""The pytest plugin (entry point `pytest11: cardgate`).

- `@pytest.mark.card("P0-003", "item-key-or-exact-text", ...)` binds a test to card items; a
  marker naming an unknown card or item (or a `(manual)` item) is a collection error.
- `--cardgate-card ID` keeps only the tests bound to that card (`--cardgate-items k1,k2`
  narrows to items and their children); `--cardgate-report PATH` writes a JSON report of every
  test phase, with bound items and metrics, collected on the xdist controller.
- `metric(name, value, unit=..., higher_is_better=...)` records a benchmark metric (tests
  marked `bench`); `parity(path)` asserts a parity JSON and records its mismatch count;
  `release_gate(path)` asserts a release-gate report decided `promote` and records the decision.
- `gpu` tests are skipped without a CUDA device (torch imported lazily; no torch = no GPU);
  `requires(module, install)` tests without that importable module (an optional package),
  the reason saying how to install it; `gate_only` tests (long benchmarks) outside the card
  gate (`--cardgate-card`) unless `--cardgate-gate-only` is given. Each skip is missing
  evidence to a gate.
- `--cardgate-timeout S` fails any test phase running longer than S seconds (SIGALRM).
- `--cardgate-testpaths` adds the ini `testpaths` to explicit path arguments (the gate's
  collection pass sees the whole suite even when a card names `Tests:` paths).
- Every report records the tests bound to the card before `-k`/`-m`/`--deselect` act, and,
  for a failed phase, whether it failed by assertion (`failure: "assertion"`) or otherwise.
- Card files under `<root>/kanban/<lane>/*.md` are collected as lint items.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import math
import os
import signal
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cardgate import hardware
from cardgate.board import KANBAN_DIR, Board, load_board, rel
from cardgate.evidence import write_json
from cardgate.parity import ParityResult, assert_parity_json
from cardgate.release import ReleaseResult, check_release_json, failure_message
from cardgate.verify import verify_card

BINDING_PROP = "cardgate_items"
METRIC_PROP = "cardgate_metric"
FAILURE_PROP = "cardgate_failure"
REPORT_VERSION = 2


@dataclass
class CardgateState:
    root: Path
    card: str | None
    items: set[str] | None
    report_path: Path | None
    board: Board | None = None
    selected: int = 0
    timeout: float | None = None
    gate_only: bool = False
    bound: dict[str, list[str]] | None = None

    def get_board(self) -> Board:
        if self.board is None:
            self.board = load_board(self.root)
        return self.board


STATE = pytest.StashKey[CardgateState]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cardgate", "kanban cards bound to tests")
    group.addoption("--cardgate-card", metavar="ID", help="run only the tests bound to card ID")
    group.addoption(
        "--cardgate-items",
        metavar="KEYS",
        help="with --cardgate-card: only tests bound to these comma-separated item keys",
    )
    group.addoption("--cardgate-report", metavar="PATH", help="write a JSON report to PATH")
    group.addoption("--cardgate-root", metavar="DIR", help="repository root (default: rootdir)")
    group.addoption(
        "--cardgate-timeout", metavar="S", type=float, help="fail a test phase after S seconds"
    )
    group.addoption(
        "--cardgate-gate-only",
        action="store_true",
        help="also run tests marked gate_only outside the card gate",
    )
    group.addoption(
        "--cardgate-testpaths",
        action="store_true",
        help="also collect the ini testpaths when paths are given",
    )
    parser.addini("cardgate_lint", type="bool", default=True, help="collect kanban cards as lint")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "card(card_id, *items): bind a test to kanban card items")
    config.addinivalue_line("markers", "bench: benchmark test that records metrics")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped = missing evidence)")
    config.addinivalue_line(
        "markers",
        "requires(module, install): needs an optional package (skipped = missing evidence)",
    )
    config.addinivalue_line(
        "markers",
        "gate_only: a long benchmark, run by its card's gate or with --cardgate-gate-only "
        "(skipped elsewhere = missing evidence)",
    )
    root_opt = config.getoption("cardgate_root")
    items_opt = config.getoption("cardgate_items")
    report_opt = config.getoption("cardgate_report")
    config.stash[STATE] = CardgateState(
        root=Path(root_opt).resolve() if root_opt else config.rootpath,
        card=config.getoption("cardgate_card"),
        items={k.strip() for k in items_opt.split(",") if k.strip()} if items_opt else None,
        report_path=Path(report_opt) if report_opt else None,
        timeout=config.getoption("cardgate_timeout"),
        gate_only=config.getoption("cardgate_gate_only"),
    )
    if config.getoption("cardgate_testpaths"):
        extra: list[str] = []
        for pattern in config.getini("testpaths") or ["."]:
            extra.extend(sorted(glob.glob(str(config.rootpath / pattern))) or [])
        config.args = [*config.args, *(a for a in extra if a not in config.args)]
    if report_opt and not _is_worker(config):
        config.pluginmanager.register(Recorder(config, Path(report_opt)), "cardgate-recorder")


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


# --- binding -------------------------------------------------------------------------------


def resolve_bindings(item: pytest.Item, board: Board) -> tuple[list[str], list[str]]:
    """(["CARD::key", ...], [error, ...]) for every `card` marker of a test."""
    bound: list[str] = []
    errors: list[str] = []
    for marker in item.iter_markers("card"):
        args = list(marker.args)
        if not args or not all(isinstance(a, str) for a in args):
            errors.append(f"{item.nodeid}: card marker needs string arguments: card(ID, item...)")
            continue
        card_id, refs = args[0], args[1:]
        card = board.cards.get(card_id)
        if card is None:
            known = ", ".join(sorted(board.cards)) or "none"
            errors.append(f"{item.nodeid}: unknown card {card_id!r} (known cards: {known})")
            continue
        if not refs:
            errors.append(f"{item.nodeid}: card({card_id!r}) names no item")
        for ref in refs:
            found = card.lookup(ref)
            if found is None:
                keys = ", ".join(card.items) or "none"
                errors.append(f"{item.nodeid}: card {card_id} has no item {ref!r} (items: {keys})")
            elif found.manual:
                errors.append(
                    f"{item.nodeid}: {card_id}::{found.key} is a (manual) item; "
                    "manual items are ticked by a person, not bound to tests"
                )
            elif f"{card_id}::{found.key}" not in bound:
                bound.append(f"{card_id}::{found.key}")
    return bound, errors


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, Any]:
    report = yield
    if not report.passed or not report.result:
        return report
    items = [node for node in report.result if isinstance(node, pytest.Item)]
    if not any(item.get_closest_marker("card") for item in items):
        return report
    board = collector.config.stash[STATE].get_board()
    errors: list[str] = []
    for item in items:
        bound, item_errors = resolve_bindings(item, board)
        errors.extend(item_errors)
        if bound:
            item.user_properties.append((BINDING_PROP, bound))
    if errors:
        report.outcome = "failed"
        report.longrepr = "cardgate binding errors:\n" + "\n".join(errors)
        report.result = []
    return report


def _bindings(item: pytest.Item) -> list[str]:
    for name, value in item.user_properties:
        if name == BINDING_PROP:
            return list(value)
    return []


def _expand_items(board: Board, card_id: str, keys: set[str]) -> set[str]:
    card = board.cards.get(card_id)
    if card is None:
        return keys
    out = set(keys)
    for key in keys:
        if key in card.items:
            out.update(card.descendants(key))
    return out


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the card's tests; runs before `-k`, `-m` and `--deselect` so `bound` is complete."""
    state = config.stash[STATE]
    if state.card is None:
        return
    state.bound = {}
    for item in items:
        keys = [b.split("::", 1)[1] for b in _bindings(item) if b.split("::", 1)[0] == state.card]
        if keys:
            state.bound[item.nodeid] = keys
    wanted_items = (
        _expand_items(state.get_board(), state.card, state.items) if state.items else None
    )
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        keys = [b.split("::", 1)[1] for b in _bindings(item) if b.split("::", 1)[0] == state.card]
        if keys and (wanted_items is None or wanted_items.intersection(keys)):
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
    state.selected = len(keep)


# --- gpu marker, timeouts, failure kind -------------------------------------------------


class PhaseTimeout(Exception):
    """A test phase ran longer than `--cardgate-timeout` (or the card's `Timeout:`)."""


@contextlib.contextmanager
def _alarm(seconds: float | None, what: str) -> Iterator[None]:
    if not seconds or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise PhaseTimeout(f"timeout: {what} ran longer than {seconds:g}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _skip_unless_importable(marker: pytest.Mark) -> None:
    args = list(marker.args)
    if not args or not all(isinstance(a, str) for a in args):
        pytest.fail("requires(module, install) needs a module name (and a hint)", pytrace=False)
    module, install = args[0], " ".join(args[1:])
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"requires {module} (missing evidence): {install or 'not installed'}")


def _skip_outside_the_gate(item: pytest.Item, marker: pytest.Mark, state: CardgateState) -> None:
    if marker.args or marker.kwargs:
        pytest.fail("gate_only takes no arguments", pytrace=False)
    if state.card is not None or state.gate_only:
        return
    cards = sorted({b.split("::", 1)[0] for b in _bindings(item)})
    how = " or ".join([*(f"nox -s card -- {c}" for c in cards), "--cardgate-gate-only"])
    pytest.skip(f"gate_only (missing evidence): runs under {how}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    state = item.config.stash[STATE]
    if item.get_closest_marker("gpu") is not None and not hardware.cuda_available():
        pytest.skip("gpu: no CUDA device (missing evidence)")
    for marker in item.iter_markers("requires"):
        _skip_unless_importable(marker)
    gate_only = item.get_closest_marker("gate_only")
    if gate_only is not None:
        _skip_outside_the_gate(item, gate_only, state)
    with _alarm(state.timeout, f"{item.nodeid} setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    with _alarm(item.config.stash[STATE].timeout, item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    with _alarm(item.config.stash[STATE].timeout, f"{item.nodeid} teardown"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and call.excinfo is not None:
        kind = "assertion" if call.excinfo.errisinstance(AssertionError) else "error"
        report.user_properties = [*report.user_properties, (FAILURE_PROP, kind)]
    return report


# --- fixtures ------------------------------------------------------------------------------


class MetricRecorder:
    """`metric(name, value, unit="", higher_is_better=True)`: record one benchmark metric."""

    def __init__(self, node: pytest.Item) -> None:
        self._node = node

    def __call__(
        self, name: str, value: float, unit: str = "", higher_is_better: bool = True
    ) -> float:
        if not isinstance(name, str) or not name.strip():
            raise ValueError("metric name must be a non-empty string")
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"metric {name!r} is not finite: {value!r}")
        if any(k == METRIC_PROP and v["name"] == name for k, v in self._node.user_properties):
            raise ValueError(f"metric {name!r} recorded twice by {self._node.nodeid}")
        record = {"name": name, "value": number, "unit": unit, "higher_is_better": higher_is_better}
        self._node.user_properties.append((METRIC_PROP, record))
        return number


@pytest.fixture
def metric(request: pytest.FixtureRequest) -> MetricRecorder:
    """Record benchmark metrics from a test marked `@pytest.mark.bench`."""
    node = request.node
    if node.get_closest_marker("bench") is None:
        pytest.fail("the metric fixture is for tests marked @pytest.mark.bench", pytrace=False)
    return MetricRecorder(node)


@pytest.fixture
def parity(request: pytest.FixtureRequest) -> Iterator[Any]:
    """`parity(path)`: fail unless the parity JSON passed; records `parity_mismatches`."""

    def check(path: Path | str, metric_name: str = "parity_mismatches") -> ParityResult:
        result = assert_parity_json(path)
        recorder = MetricRecorder(request.node)
        recorder(metric_name, float(result.mismatches or 0), unit="count", higher_is_better=False)
        return result

    yield check


@pytest.fixture
def release_gate(request: pytest.FixtureRequest) -> Iterator[Any]:
    """`release_gate(path)`: fail unless the release-gate report's decision is `promote`;
    records `release_decision` (0 promote, 1 hold, 2 rollback; lower is better) whenever the
    report has a decision, so a hold or rollback is evidence too."""

    def check(path: Path | str, metric_name: str = "release_decision") -> ReleaseResult:
        result = check_release_json(path)
        if result.code is not None:
            recorder = MetricRecorder(request.node)
            recorder(metric_name, float(result.code), unit="decision", higher_is_better=False)
        if not result.passed:
            raise AssertionError(failure_message(result))
        return result

    yield check


# --- reporting (controller only) -----------------------------------------------------------


def _message(report: pytest.TestReport | pytest.CollectReport, root: Path) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2]).removeprefix("Skipped: ")
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = getattr(crash, "message", None) or str(longrepr)
    text = text.replace(str(root), ".").replace(os.path.expanduser("~"), "~")
    return text if len(text) <= 2000 else text[:2000] + "..."


class Recorder:
    """Collects every test phase on the controller (xdist workers forward their reports)."""

    def __init__(self, config: pytest.Config, path: Path) -> None:
        self.config = config
        self.path = path
        self.tests: list[dict[str, Any]] = []
        self.collection_errors: list[dict[str, Any]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        root = self.config.stash[STATE].root
        bound: list[str] = []
        metrics: list[dict[str, Any]] = []
        failure: str | None = None
        for name, value in report.user_properties:
            if name == BINDING_PROP:
                bound = list(value)
            elif name == METRIC_PROP and report.when == "teardown":
                metrics.append(dict(value))
            elif name == FAILURE_PROP:
                failure = str(value)
        self.tests.append(
            {
                "nodeid": report.nodeid,
                "when": report.when,
                "outcome": report.outcome,
                "duration": round(report.duration, 6),
                "items": bound,
                "metrics": metrics,
                "wasxfail": hasattr(report, "wasxfail"),
                "failure": failure,
                "message": "" if report.passed else _message(report, root),
            }
        )

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            root = self.config.stash[STATE].root
            self.collection_errors.append(
                {"nodeid": report.nodeid, "message": _message(report, root)}
            )

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        state = self.config.stash[STATE]
        gpu = hardware.gpu_info()
        report = {
            "version": REPORT_VERSION,
            "card": state.card,
            "items_filter": sorted(state.items) if state.items else None,
            "exitstatus": int(exitstatus),
            "selected": state.selected,
            "bound": state.bound,
            "tests": self.tests,
            "collection_errors": self.collection_errors,
            "hardware": hardware.hardware_key(gpu),
            "gpu": gpu or None,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self.path.unlink()
        write_json(self.path, report)


# --- kanban lint items ---------------------------------------------------------------------


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    config = parent.config
    if file_path.suffix != ".md" or not config.getini("cardgate_lint"):
        return None
    root = config.stash[STATE].root
    if file_path.parent.parent != root / KANBAN_DIR:
        return None
    return CardFile.from_parent(parent, path=file_path)


class CardLintError(Exception):
    pass


class CardFile(pytest.File):
    def collect(self) -> Iterator[pytest.Item]:
        yield CardLintItem.from_parent(self, name="lint")


class CardLintItem(pytest.Item):
    """Fails with `file:line: message` lines when the card (or the board around it) is broken."""

    def runtest(self) -> None:
        state = self.config.stash[STATE]
        board = state.get_board()
        where = rel(self.path, state.root)
        problems = [str(e) for e in board.errors_for(where)]
        card = next((c for c in board.cards.values() if c.path == where), None)
        if card is not None:
            problems += [f"{where}:1: {flag}" for flag in verify_card(state.root, card).flags]
        if problems:
            raise CardLintError("\n".join(problems))

    def repr_failure(
        self,
        excinfo: pytest.ExceptionInfo[BaseException],
        style: Any = None,
    ) -> str:
        if isinstance(excinfo.value, CardLintError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"card lint: {self.path.name}"


def load_report(path: Path | str) -> dict[str, Any]:
    """Read a report written by `--cardgate-report`."""
    return json.loads(Path(path).read_text(encoding="utf-8"))
