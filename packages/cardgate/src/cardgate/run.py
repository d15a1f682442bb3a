"""Gate stage 2: pytest in subprocesses, in a clean room.

Every pytest process runs in a fresh checkout of the recorded commit (`cardgate.room`, read
from git's raw objects), with an environment the gate builds (`cardgate.environ`) and the
room's imports redirected from the working tree (`cardgate.roomplugin`). Paths recorded are
relative to the room, which is the commit. When nothing could narrow the run (no `-n`, no arguments after `--`, no `PYTEST_ADDOPTS`), one
pytest run over the whole suite (ini `testpaths` plus the card's `Tests:` paths) both finds
every test bound to the card and runs them. Otherwise a collection pass over the whole suite
(without those arguments) finds the bound tests first, and the run itself, on those tests'
files with the user's arguments, writes the JSON report the decide stage reads. The effective arguments and environment overrides are
part of the result (and of the manifest).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from cardgate import environ
from cardgate.hardware import hardware_key
from cardgate.outcome import Phase
from cardgate.preflight import GateOptions, Preflight
from cardgate.recorder import load_report
from cardgate.redact import redact
from cardgate.scan import scan_files, scan_tests

ENV_PREFIXES = ("MINISGL_", "CARDGATE_", "PYTEST_")


@dataclass(frozen=True)
class Metric:
    name: str
    value: float
    unit: str
    higher_is_better: bool
    nodeid: str


@dataclass(frozen=True)
class TestPhase:
    nodeid: str
    when: str
    outcome: str
    message: str
    failure: str | None
    wasxfail: bool
    metrics: tuple[Metric, ...]
    source_sha256: str | None = None
    duration: float = 0.0
    path: str | None = None  # where the test is defined (relative to the room)
    line: int | None = None


@dataclass(frozen=True)
class StaticTest:
    """A test function the static scan of the commit finds bound to `key` (`scan.BoundTest`)."""

    path: str
    name: str
    first: int
    last: int
    key: str

    @property
    def nodeid(self) -> str:
        return f"{self.path}::{self.name}"


@dataclass(frozen=True)
class Inventory:
    """What ran besides the tests (`cardgate.inventory`), over every pytest process."""

    plugins: tuple[dict[str, Any], ...] = ()
    fixture_overrides: tuple[dict[str, str], ...] = ()
    modules: tuple[str, ...] = ()
    outside_modules: tuple[str, ...] = ()
    environment: dict[str, Any] = field(default_factory=dict)
    worktree_modules: tuple[str, ...] = ()  # imported from the working tree, not the room
    shadowed_modules: tuple[str, ...] = ()  # the commit's modules, run from outside the room

    def to_dict(self) -> dict[str, Any]:
        return {
            "plugins": list(self.plugins),
            "fixture_overrides": list(self.fixture_overrides),
            "imported_modules": list(self.modules),
            "outside_modules": list(self.outside_modules),
            "worktree_modules": list(self.worktree_modules),
            "shadowed_modules": list(self.shadowed_modules),
            "environment": dict(self.environment),
        }


@dataclass(frozen=True)
class RunResult:
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    returncode: int | None
    timed_out: bool
    phases: tuple[TestPhase, ...]
    collection_errors: tuple[tuple[str, str], ...]
    bound: dict[str, tuple[str, ...]]  # item key -> every node id bound to it (whole suite)
    hardware: str
    raw_tests: tuple[dict[str, Any], ...]
    static_bindings: tuple[tuple[str, str], ...] = ()  # (file, item key) by a static scan
    inventory: Inventory = field(default_factory=Inventory)
    hardware_source: str = "none"
    limit_s: float | None = None  # the run's time limit (None: no run)
    room: dict[str, Any] | None = None  # the clean room (None: no commit, ran in place)
    env_dropped: tuple[str, ...] = ()
    static_tests: tuple[StaticTest, ...] = ()  # bound test functions, by a static scan
    narrowed: bool = False  # the caller narrowed the run (`-k` on a dry run)

    @property
    def static_files(self) -> tuple[str, ...]:
        return tuple(sorted({path for path, _ in self.static_bindings}))

    def sources(self) -> dict[str, str]:
        """nodeid -> sha256 of the bound test's source, as this run collected it."""
        return {p.nodeid: p.source_sha256 for p in self.phases if p.source_sha256}

    def test_sides(self) -> dict[str, dict[str, Any]]:
        """nodeid -> the bound test's test side (`cardgate.testside`), as this run saw it."""
        return {
            str(r["nodeid"]): r["test_side"]
            for r in self.raw_tests
            if isinstance(r.get("test_side"), dict)
        }

    def test_side_files(self) -> dict[str, str]:
        """path -> sha256 of every test-side file the bound tests ran from (module, conftests,
        fixture files): what a red record pins."""
        files: dict[str, str] = {}
        for side in self.test_sides().values():
            files.update(side.get("files") or {})
        return dict(sorted(files.items()))


DEFAULT_RUN_LIMIT_S = 3600.0  # a whole pytest run, when neither --run-limit nor Timeout: says


def run_limit(asked: float | None, test_timeout: float | None, num_tests: int) -> float:
    """Seconds the pytest run may take before the gate kills it: `--run-limit`, else three
    times the card's per-test `Timeout:` for each bound test (10 at least) plus two minutes,
    else `DEFAULT_RUN_LIMIT_S` (a test process that hangs at its exit must not hang the gate)."""
    if asked:
        return asked
    if test_timeout:
        return test_timeout * 3 * max(10, num_tests) + 120
    return DEFAULT_RUN_LIMIT_S


def env_overrides(env: dict[str, str], root: Path) -> tuple[tuple[str, str], ...]:
    """The child's variables that steer a run (`ENV_PREFIXES`), as recorded."""
    return tuple(
        (k, redact(v, root))
        for k, v in sorted(env.items())
        if k.startswith(ENV_PREFIXES) and k != environ.ROOM_SOURCE_ENV
    )


def _base(opts: GateOptions, pre: Preflight, report: Path, where: Path) -> list[str]:
    cmd = [opts.python or sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    cmd += ["-p", "cardgate.roomplugin"]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        cmd += ["-p", "cardgate"] + (["-p", "xdist"] if opts.workers else [])
    return [
        *cmd,
        f"--rootdir={where}",
        f"--cardgate-card={pre.card.id}",
        f"--cardgate-report={report}",
        f"--cardgate-root={where}",
    ]


def _collect(
    opts: GateOptions,
    pre: Preflight,
    tmp: Path,
    stream: TextIO,
    static: list[str],
    where: Path,
    env: dict[str, str],
) -> dict[str, Any]:
    report = tmp / "collect.json"
    cmd = [*_base(opts, pre, report, where), "--collect-only", "-q", "--cardgate-testpaths"]
    cmd += [*pre.card.tests, *static]
    subprocess.run(cmd, cwd=where, env=env, stdout=subprocess.DEVNULL, stderr=stream)
    return load_report(report) if report.exists() else {}


def _single_pass(opts: GateOptions) -> bool:
    """Nothing can narrow the run: one pytest run over the whole suite also finds the bindings.

    (Under xdist the controller collects nothing, so `-n` always takes a collection pass.)
    """
    return not opts.workers and not opts.pytest_args


def _by_key(report: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    bound: dict[str, set[str]] = {}
    for nodeid, keys in (report.get("bound") or {}).items():
        for key in keys:
            bound.setdefault(key, set()).add(nodeid)
    return {k: tuple(sorted(v)) for k, v in bound.items()}


def _errors(report: dict[str, Any]) -> list[tuple[str, str]]:
    return [(e["nodeid"], e.get("message", "")) for e in report.get("collection_errors", [])]


def run_pytest(
    opts: GateOptions,
    pre: Preflight,
    out: Callable[[str], None],
    stream: TextIO,
    where: Path | None = None,
) -> RunResult:
    """Run the card's tests in `where` (the clean room; default: the working tree)."""
    return _run_in(opts, pre, out, stream, where or pre.root)


def _run_in(
    opts: GateOptions, pre: Preflight, out: Callable[[str], None], stream: TextIO, where: Path
) -> RunResult:
    single = _single_pass(opts)
    wanted = _expand(pre, set(pre.red_keys)) if opts.phase is Phase.RED else None
    static_bindings = _static_bindings(pre, where)
    static = sorted({path for path, _ in static_bindings})  # passed explicitly to pytest
    env = environ.gate_env((opts.source or pre.root).resolve())
    with tempfile.TemporaryDirectory(prefix="cardgate-") as tmp_name:
        tmp = Path(tmp_name)
        errors: list[tuple[str, str]] = []
        bound: dict[str, tuple[str, ...]] = {}
        if single:
            paths = ["--cardgate-testpaths", *pre.card.tests, *static]
        else:
            collected = _collect(opts, pre, tmp, stream, static, where, env)
            if not collected:
                errors.append(("<collection>", "the collection pass wrote no report"))
            errors += _errors(collected)
            bound = _by_key(collected)
            paths = sorted(
                {
                    n.split("::", 1)[0]
                    for k, ns in bound.items()
                    for n in ns
                    if not wanted or k in wanted
                }
                | ({*static} if not wanted else set())
            )
        report = tmp / "report.json"
        cmd = _base(opts, pre, report, where)
        if wanted is not None:
            cmd.append(f"--cardgate-items={','.join(sorted(wanted))}")
        if pre.timeout:
            cmd.append(f"--cardgate-timeout={pre.timeout:g}")
        if opts.workers:
            cmd += ["-n", opts.workers]
        cmd += [*opts.pytest_args, *paths]
        returncode: int | None = None
        timed_out = False
        limit: float | None = None
        data: dict[str, Any] = {}
        if paths:
            out(f"cardgate: {' '.join(redact(a, where) for a in cmd[1:])}")
            limit = run_limit(pre.run_limit, pre.timeout, sum(map(len, bound.values())))
            try:
                proc = subprocess.run(cmd, cwd=where, env=env, stdout=stream, timeout=limit)
                returncode = proc.returncode
            except subprocess.TimeoutExpired:
                timed_out = True
            data = load_report(report) if report.exists() else {}
            errors += _errors(data)
            if single:
                bound = _by_key(data)
                if not data:
                    errors.append(("<run>", "pytest wrote no report"))
    phases = tuple(_phase(rec) for rec in data.get("tests", []))
    return RunResult(
        command=tuple(redact(a, where) for a in cmd[1:]),
        env=env_overrides(env, where),
        env_dropped=tuple(environ.dropped()),
        returncode=returncode,
        timed_out=timed_out,
        limit_s=limit,
        phases=phases,
        collection_errors=tuple(dict.fromkeys(errors)),
        bound=bound,
        hardware=str(data.get("hardware") or hardware_key()),
        raw_tests=tuple(data.get("tests", [])),
        static_bindings=static_bindings,
        static_tests=_static_tests(pre, where),
        narrowed=any(a.startswith("-k") for a in opts.pytest_args),
        inventory=Inventory(
            plugins=tuple(data.get("plugins", [])),
            fixture_overrides=tuple(data.get("fixture_overrides", [])),
            modules=tuple(data.get("modules", [])),
            outside_modules=tuple(data.get("outside_modules", [])),
            environment=dict(data.get("environment") or {}),
            worktree_modules=tuple(data.get("worktree_modules", [])),
            shadowed_modules=tuple(data.get("shadowed_modules", [])),
        ),
        hardware_source=str(data.get("hardware_source") or "none"),
    )


def _static_bindings(pre: Preflight, where: Path) -> tuple[tuple[str, str], ...]:
    found = set()
    for binding in scan_files(where):
        item = pre.card.lookup(binding.ref) if binding.card == pre.card.id else None
        if item is not None:
            found.add((binding.path, item.key))
    return tuple(sorted(found))


def _static_tests(pre: Preflight, where: Path) -> tuple[StaticTest, ...]:
    found = set()
    for test in scan_tests(where):
        item = pre.card.lookup(test.ref) if test.card == pre.card.id else None
        if item is not None:
            found.add(StaticTest(test.path, test.name, test.first, test.last, item.key))
    return tuple(sorted(found, key=lambda t: (t.path, t.first, t.name, t.key)))


def _expand(pre: Preflight, keys: set[str]) -> set[str]:
    out = set(keys)
    for key in keys:
        out.update(pre.card.descendants(key))
    return out


def _phase(rec: dict[str, Any]) -> TestPhase:
    return TestPhase(
        nodeid=rec["nodeid"],
        when=rec["when"],
        outcome=rec["outcome"],
        message=rec.get("message") or "",
        failure=rec.get("failure"),
        wasxfail=bool(rec.get("wasxfail")),
        source_sha256=rec.get("source_sha256"),
        duration=float(rec.get("duration") or 0.0),
        path=rec.get("path"),
        line=rec.get("line"),
        metrics=tuple(
            Metric(
                name=m["name"],
                value=float(m["value"]),
                unit=m.get("unit", ""),
                higher_is_better=bool(m.get("higher_is_better", True)),
                nodeid=rec["nodeid"],
            )
            for m in rec.get("metrics", [])
        ),
    )
