"""The JSON report of a run (`--cardgate-report PATH`), written on the xdist controller.

Every test phase with its bound items, metrics, failure kind, the bound test's source hash and
where the test is defined (`path`, `line`), and on its setup phase its test side
(`cardgate.testside`);
and what ran besides the tests (`inventory`), merged over the controller and every worker.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from cardgate import hardware, inventory
from cardgate.evidence import write_json
from cardgate.fixtures import METRIC_PROP
from cardgate.redact import redact
from cardgate.room import ROOM_SOURCE_ENV
from cardgate.state import STATE

REPORT_VERSION = 3
BINDING_PROP = "cardgate_items"
FAILURE_PROP = "cardgate_failure"
SOURCE_PROP = "cardgate_source"
TEST_SIDE_PROP = "cardgate_test_side"
WORKER_KEY = "cardgate_inventory"


def message_of(report: pytest.TestReport | pytest.CollectReport, root: Path) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2]).removeprefix("Skipped: ")
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = getattr(crash, "message", None) or str(longrepr)
    text = redact(text, root)
    return text if len(text) <= 2000 else text[:2000] + "..."


def _defined_at(report: pytest.TestReport) -> dict[str, Any]:
    """Where the test that ran is defined (`path` relative to the rootdir, 1-based `line`):
    the gate matches it with the static scan's bound functions."""
    path, line, _ = report.location
    return {"path": str(path), "line": line + 1} if line is not None else {"path": str(path)}


def process_inventory(config: pytest.Config, items: list[pytest.Item]) -> dict[str, Any]:
    """What this process ran besides the tests (see `cardgate.inventory`)."""
    root = config.stash[STATE].root
    modules, outside = inventory.repo_modules(root)
    source = os.environ.get(ROOM_SOURCE_ENV)
    return {
        "worktree_modules": inventory.worktree_modules(Path(source) if source else None),
        "shadowed_modules": inventory.shadowed_modules(root if source else None),
        "plugins": inventory.plugins(config, root),
        "fixture_overrides": inventory.fixture_overrides(items, root),
        "modules": modules,
        "outside_modules": outside,
        "environment": inventory.environment(root),
    }


def merge_inventories(parts: list[dict[str, Any]]) -> dict[str, Any]:
    plugins: dict[str, dict[str, Any]] = {}
    for part in parts:
        for entry in part.get("plugins", []):
            seen = plugins.setdefault(entry["name"], dict(entry))
            seen["hooks"] = sorted(set(seen["hooks"]) | set(entry["hooks"]))
            seen["allowed"] = bool(seen["allowed"] and entry["allowed"])
    overrides = {
        (o["fixture"], o["where"]): o for part in parts for o in part.get("fixture_overrides", [])
    }
    return {
        "plugins": sorted(plugins.values(), key=lambda e: e["name"]),
        "fixture_overrides": sorted(overrides.values(), key=lambda o: (o["fixture"], o["where"])),
        "modules": sorted({m for part in parts for m in part.get("modules", [])}),
        "outside_modules": sorted({m for part in parts for m in part.get("outside_modules", [])}),
        "worktree_modules": sorted({m for part in parts for m in part.get("worktree_modules", [])}),
        "shadowed_modules": sorted({m for part in parts for m in part.get("shadowed_modules", [])}),
        "environment": next((p["environment"] for p in parts if p.get("environment")), {}),
    }


class Recorder:
    """Collects every test phase on the controller (xdist workers forward their reports)."""

    def __init__(self, config: pytest.Config, path: Path) -> None:
        self.config = config
        self.path = path
        self.tests: list[dict[str, Any]] = []
        self.collection_errors: list[dict[str, Any]] = []
        self.inventories: list[dict[str, Any]] = []
        self.items: list[pytest.Item] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        root = self.config.stash[STATE].root
        bound: list[str] = []
        metrics: list[dict[str, Any]] = []
        failure: str | None = None
        source: str | None = None
        side: dict[str, Any] | None = None
        for name, value in report.user_properties:
            if name == BINDING_PROP:
                bound = list(value)
            elif name == METRIC_PROP and report.when == "teardown":
                metrics.append(dict(value))
            elif name == FAILURE_PROP:
                failure = str(value)
            elif name == SOURCE_PROP:
                source = str(value)
            elif name == TEST_SIDE_PROP and report.when == "setup":
                side = dict(value)
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
                "source_sha256": source,
                "message": "" if report.passed and failure is None else message_of(report, root),
                **_defined_at(report),
                **({"test_side": side} if side else {}),
            }
        )

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            root = self.config.stash[STATE].root
            self.collection_errors.append(
                {"nodeid": report.nodeid, "message": message_of(report, root)}
            )

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.items = list(session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        raw = getattr(node, "workeroutput", {}).get(WORKER_KEY)
        if raw:
            self.inventories.append(json.loads(raw))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        state = self.config.stash[STATE]
        gpu = hardware.gpu_info()
        ran = merge_inventories([process_inventory(self.config, self.items), *self.inventories])
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
            "hardware_source": hardware.hardware_source(gpu),
            "gpu": gpu or None,
            **ran,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self.path.unlink()
        write_json(self.path, report)


def load_report(path: Path | str) -> dict[str, Any]:
    """Read a report written by `--cardgate-report`."""
    return json.loads(Path(path).read_text(encoding="utf-8"))
