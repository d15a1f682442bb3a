"""The pytest plugin (entry point `pytest11: cardgate`): options and hooks only; the parts live
in their own modules, after pytest-benchmark's split:

- bindings (`@pytest.mark.card("P0-003", "item-key-or-exact-text", ...)`): here; a marker naming
  an unknown card or item (or a `(manual)` item) is a collection error. `--cardgate-card ID`
  keeps only the tests bound to that card (`--cardgate-items k1,k2` narrows to items and their
  children); the tests bound before `-k`/`-m`/`--deselect` act are recorded.
- fixtures (`cardgate.fixtures`): `metric`, `parity`, `release_gate`.
- skips: `gpu` tests without a CUDA device, `requires(module, install)` without the module,
  `gate_only` tests outside the card gate unless `--cardgate-gate-only`: each is missing evidence.
- timeouts (`cardgate.timeouts`): `--cardgate-timeout S` fails a phase running longer than S.
- the report (`cardgate.recorder`, `--cardgate-report PATH`): every phase, failure kind
  (`assertion` / `error`, also when a report claims `passed` while the test raised), source hash
  of bound tests, their test side (`cardgate.testside`: the test-side files and what the test
  reads from them), and the run's inventory (`cardgate.inventory`) from every process.
- lint items (`cardgate.lintitems`): card files under `<root>/kanban/<lane>/*.md`.
- `--cardgate-testpaths` adds the ini `testpaths` to explicit path arguments.
"""

from __future__ import annotations

import glob
import importlib.util
import json
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from cardgate import hardware
from cardgate.board import Board
from cardgate.fixtures import MetricRecorder, metric, parity, release_gate
from cardgate.inventory import INI_PLUGINS, source_sha256
from cardgate.lintitems import CardFile, CardLintError, CardLintItem, collect_card
from cardgate.recorder import (
    BINDING_PROP,
    FAILURE_PROP,
    REPORT_VERSION,
    SOURCE_PROP,
    TEST_SIDE_PROP,
    WORKER_KEY,
    Recorder,
    load_report,
    process_inventory,
)
from cardgate.state import STATE, CardgateState
from cardgate.testside import pin_test_side
from cardgate.timeouts import PhaseTimeout, alarm

__all__ = [
    "BINDING_PROP",
    "FAILURE_PROP",
    "REPORT_VERSION",
    "STATE",
    "CardFile",
    "CardLintError",
    "CardLintItem",
    "CardgateState",
    "MetricRecorder",
    "PhaseTimeout",
    "Recorder",
    "load_report",
    "metric",
    "parity",
    "release_gate",
    "resolve_bindings",
]


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
    parser.addini(
        INI_PLUGINS,
        type="linelist",
        default=[],
        help="plugins and conftest files (module names or repo-relative paths) allowed to "
        "implement report hooks under the card gate",
    )


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
            digest = source_sha256(item)
            if digest:
                item.user_properties.append((SOURCE_PROP, digest))
            side = pin_test_side(item, collector.config.stash[STATE].root)
            if side:
                item.user_properties.append((TEST_SIDE_PROP, side))
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


# --- skips, timeouts, failure kind -----------------------------------------------------------


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
    with alarm(state.timeout, f"{item.nodeid} setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    with alarm(item.config.stash[STATE].timeout, item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    with alarm(item.config.stash[STATE].timeout, f"{item.nodeid} teardown"):
        return (yield)


_NOT_FAILURES = (pytest.skip.Exception, pytest.xfail.Exception)
# The test's own checks: an assert, and pytest's `Failed` (`pytest.fail`, a `pytest.raises` that
# saw nothing raised). Any other exception is an error (a crash, a missing name or fixture).
_CHECKS = (AssertionError, pytest.fail.Exception)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Outermost: sees the report after every other plugin; a phase that raised is a failure
    of that kind even if some plugin rewrote the report to `passed`."""
    report = yield
    excinfo = call.excinfo
    if excinfo is not None and not excinfo.errisinstance(_NOT_FAILURES):
        kind = "assertion" if excinfo.errisinstance(_CHECKS) else "error"
        if report.passed:
            kind += "; the report says passed"
        report.user_properties = [*report.user_properties, (FAILURE_PROP, kind)]
    return report


# --- the run's inventory from every process ----------------------------------------------


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if _is_worker(config) and config.getoption("cardgate_report"):
        inventory = process_inventory(config, list(session.items))
        config.workeroutput[WORKER_KEY] = json.dumps(inventory)  # type: ignore[attr-defined]


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    return collect_card(file_path, parent, parent.config.stash[STATE].root)
