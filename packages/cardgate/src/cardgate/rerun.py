"""`cardgate verify --rerun ID`: a stranger's re-run of a done card's green gate.

The card's newest passing green record names a commit. The re-run clones the repository into a
temporary folder (`git clone --shared --no-checkout`: the objects are shared, not copied; none of
the repository's local config, attributes file, replace refs, hooks or sparse checkout comes
along), checks that commit out, and runs there **the commit's own gate**, as the repository
says its gate is run (`[tool.cardgate] rerun` in HEAD's `pyproject.toml`, e.g. `python3 -m nox
-s card --`: the commit's noxfile installs the commit's runtime, builds its Rust binary and runs
its cardgate; without it, the installed `cardgate gate`), as `ID --phase green --dry-run --json`
with the recorded `--allow-changed-tests` and pytest arguments, in an environment built from an
allowlist (the gate's own, and what installers need: `RERUN_PREFIXES`). The decision and every
item's status it prints are compared with the record. The rules are the ones that decided the
record: today's gate judging an old commit would mix two versions of the rules and of the code.
The repository's working tree, index, refs and evidence stay as they were.

Exit codes: 0 the re-run agrees with the record, 1 it does not (the differences are listed; a
gate that could not start or finish is a difference), 3 nothing to re-run (an unknown card, a
card not in `done/`, no passing green record, a commit this repository does not hold, a
malformed `[tool.cardgate] rerun`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cardgate import evidence, gitutil
from cardgate.board import load_board
from cardgate.environ import clean_env
from cardgate.outcome import GateUsageError
from cardgate.verify import newest_green

ABSENT = "absent"
DEFAULT_COMMAND = ("{python}", "-m", "cardgate", "gate")
# What a gate's installers need beside the gate's own allowlist (`environ.ALLOWED`): package
# indexes and certificates, the Rust and Python toolchains. None of them reaches a test run of a
# clean-room gate, which builds its pytest environment again from its own allowlist.
RERUN_PREFIXES = ("PIP_", "UV_", "CARGO_", "RUSTUP_", "PYENV_", "SSL_CERT_", "REQUESTS_CA_BUNDLE",
                  "CURL_CA_BUNDLE")  # fmt: skip
SETUP_ALLOWANCE_S = 1800.0  # installing the commit's runtime and building its Rust binary
DEFAULT_TIMEOUT_S = 3600.0  # a record without a timeout


@dataclass(frozen=True)
class Difference:
    """One thing the re-run decided otherwise: `what` is `outcome` or an item key."""

    what: str
    recorded: str
    rerun: str
    reason: str = ""

    def __str__(self) -> str:
        why = f" ({self.reason})" if self.reason else ""
        return f"{self.what}: recorded {self.recorded}, re-run {self.rerun}{why}"


@dataclass(frozen=True)
class GateRun:
    """What the commit's own gate printed: its decision as JSON (None when it printed none),
    its exit code and the tail of its output."""

    command: tuple[str, ...]
    exit_code: int
    report: dict[str, Any] | None
    tail: str


@dataclass(frozen=True)
class Rerun:
    card_id: str
    record_dir: str
    commit: str
    run: GateRun
    differences: tuple[Difference, ...]
    seconds: float

    @property
    def agrees(self) -> bool:
        return not self.differences

    @property
    def exit_code(self) -> int:
        return 0 if self.agrees else 1


def compare(
    summary: dict[str, Any], report: dict[str, Any] | None, why: str = ""
) -> list[Difference]:
    """The recorded decision and item statuses against the re-run's report (`None`: the gate
    printed no decision; `why` says what it printed instead)."""
    out: list[Difference] = []
    recorded = str(summary.get("outcome", "?"))
    rerun = str(report.get("outcome", "?")) if report is not None else ABSENT
    if recorded != rerun:
        out.append(Difference("outcome", recorded, rerun, why[:300]))
    before = {str(i.get("key")): str(i.get("status")) for i in summary.get("items") or ()}
    after = {
        str(i.get("key")): i
        for i in (report or {}).get("items") or ()
        if isinstance(i, dict) and i.get("key")
    }
    for key in [*before, *(k for k in after if k not in before)]:
        now = after.get(key)
        status = str(now.get("status")) if now is not None else ABSENT
        if before.get(key, ABSENT) != status:
            reason = str(now.get("reason", ""))[:300] if now is not None else ""
            out.append(Difference(key, before.get(key, ABSENT), status, reason))
    return out


def rerun_command(root: Path, python: str) -> tuple[str, ...]:
    """How the repository runs its gate: `[tool.cardgate] rerun` of HEAD's `pyproject.toml`
    (`{python}` stands for this interpreter), else the installed gate."""
    shown = gitutil.git(root, "show", "HEAD:pyproject.toml", check=False)
    config: Any = None
    if shown.returncode == 0:
        try:
            config = tomllib.loads(shown.stdout).get("tool", {}).get("cardgate", {}).get("rerun")
        except tomllib.TOMLDecodeError as exc:
            raise GateUsageError(f"pyproject.toml (HEAD): {exc}") from exc
    if config is None:
        config = list(DEFAULT_COMMAND)
    if not (isinstance(config, list) and config and all(isinstance(a, str) and a for a in config)):
        raise GateUsageError(
            "pyproject.toml (HEAD): [tool.cardgate] rerun must be a non-empty list of strings"
        )
    return tuple(python if a == "{python}" else a for a in config)


def rerun_env(inherited: Mapping[str, str] | None = None) -> dict[str, str]:
    """The re-run's environment: the gate's allowlist and the installers' variables. No build
    folder of its own: the commit's build puts its outputs where it expects them (a shared
    CARGO_TARGET_DIR had moved P1-011's binary away from the path its noxfile copies from)."""
    env = dict(os.environ if inherited is None else inherited)
    out = clean_env(env)
    out.update({k: v for k, v in env.items() if k.startswith(RERUN_PREFIXES)})
    return out


def last_json_object(text: str) -> dict[str, Any] | None:
    """The last top-level JSON object in `text`: the gate prints it with indent=2, from a `{`
    line; whatever follows its closing brace (a merged stderr line, nox's log) is not JSON."""
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    decoder = json.JSONDecoder()
    for k in range(len(lines) - 1, -1, -1):
        if lines[k].rstrip("\r\n") != "{":
            continue
        try:
            value, _ = decoder.raw_decode(text, offsets[k])
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def run_own_gate(
    clone: Path,
    command: tuple[str, ...],
    args: list[str],
    timeout_s: float,
    out: Callable[[str], None],
) -> GateRun:
    """Run `command + args` in `clone`, echo its output, and read the decision it printed."""
    argv = (*command, *args)
    out(f"cardgate: {' '.join(argv)}")
    lines: list[str] = []  # stdout: where the gate prints its JSON
    echoed: list[str] = []  # both streams, in the order they came
    try:
        proc = subprocess.Popen(
            argv,
            cwd=clone,
            env=rerun_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,
        )
    except OSError as exc:
        return GateRun(argv, 127, None, f"{argv[0]}: {exc}")
    timed_out = threading.Event()

    def kill() -> None:  # a gate that hangs without a word is stopped too
        timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def echo(line: str) -> None:
        echoed.append(line.rstrip("\n"))
        out(f"| {echoed[-1]}")

    assert proc.stdout is not None and proc.stderr is not None
    errors = threading.Thread(target=lambda: [echo(x) for x in proc.stderr], daemon=True)
    watchdog = threading.Timer(timeout_s, kill)
    watchdog.start()
    errors.start()
    try:
        with proc:
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                echo(line)
            errors.join()
            code = proc.wait()
    finally:
        watchdog.cancel()
    tail = "\n".join(echoed[-12:])
    if timed_out.is_set():
        return GateRun(argv, code, None, f"did not finish in {timeout_s:.0f} s\n{tail}")
    return GateRun(argv, code, last_json_object("\n".join(lines)), tail)


def _clone(root: Path, commit: str, dest: Path) -> None:
    """A fresh clone of `root` at `commit`, as a stranger would have it."""
    gitutil.git(root, "clone", "-q", "--shared", "--no-checkout", str(root), str(dest))
    gitutil.git(
        dest,
        "-c",
        "core.attributesFile=/dev/null",
        "--no-replace-objects",
        "checkout",
        "-q",
        "--detach",
        commit,
    )


@dataclass(frozen=True)
class RecordedOptions:
    """What the recorded gate was run with (its manifest): its timeout, whether it took
    `--allow-changed-tests`, and the caller's pytest arguments (after `--`)."""

    timeout_s: float | None
    allow_changed_tests: bool
    pytest_args: tuple[str, ...]

    @classmethod
    def of(cls, record: evidence.Record) -> RecordedOptions:
        manifest = record.manifest()
        timeout = manifest.get("timeout_s")
        args = manifest.get("pytest_args") or []
        return cls(
            float(timeout) if isinstance(timeout, int | float) and timeout > 0 else None,
            bool(manifest.get("allow_changed_tests")),
            tuple(str(a) for a in args) if isinstance(args, list) else (),
        )

    def gate_args(self, card_id: str, workers: str | None) -> list[str]:
        args = [card_id, "--phase", "green", "--dry-run", "--json"]
        args += ["--allow-changed-tests"] if self.allow_changed_tests else []
        args += ["-n", workers] if workers else []
        return args + (["--", *self.pytest_args] if self.pytest_args else [])


def rerun_card(
    root: Path,
    card_id: str,
    *,
    workers: str | None = None,
    python: str = "",
    out: Callable[[str], None] = print,
) -> Rerun:
    """Re-run the newest passing green record of a done card with the commit's own gate;
    raises `GateUsageError` (exit 3) when there is nothing to re-run."""
    root = root.resolve()
    board = load_board(root)
    card = board.cards.get(card_id)
    if card is None:
        raise GateUsageError(f"unknown card {card_id!r}")
    if card.lane != "done":
        raise GateUsageError(f"{card_id} is in {card.lane}/, not done/: nothing to re-run")
    record = newest_green(root, card)
    if record is None:
        raise GateUsageError(f"{card_id} has no passing green record the gate wrote")
    commit = gitutil.resolve(root, record.commit)
    if commit is None:
        raise GateUsageError(f"{record.path.name} names commit {record.commit!r}, unknown here")
    command = rerun_command(root, python or sys.executable)
    recorded = RecordedOptions.of(record)
    args = recorded.gate_args(card_id, workers)
    rel = record.path.relative_to(root).as_posix()
    out(f"cardgate: re-running {rel} (commit {commit[:10]}) in a fresh clone with its own gate")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cardgate-rerun-") as tmp:
        clone = Path(tmp) / "clone"
        _clone(root, commit, clone)
        limit = (recorded.timeout_s or DEFAULT_TIMEOUT_S) + SETUP_ALLOWANCE_S
        run = run_own_gate(clone, command, args, limit, out)
    why = "" if run.report is not None else f"exit {run.exit_code}, no decision printed: {run.tail}"
    return Rerun(
        card_id=card_id,
        record_dir=rel,
        commit=commit,
        run=run,
        differences=tuple(compare(record.summary, run.report, why)),
        seconds=time.monotonic() - started,
    )


def rerun_summary(rerun: Rerun) -> str:
    decision = (rerun.run.report or {}).get("outcome", ABSENT)
    head = (
        f"re-run of {rerun.record_dir} at {rerun.commit[:10]}: decision {decision} "
        f"({rerun.seconds:.1f} s, the commit's own gate: {' '.join(rerun.run.command)})"
    )
    if rerun.agrees:
        return f"{head}\nagree: the decision and every item match the record"
    lines = [head, f"differ: {len(rerun.differences)} differences from the record:"]
    lines.extend(f"  {d}" for d in rerun.differences)
    return "\n".join(lines)
