"""Repository-wide pytest hooks: the `rust_ext` and `suite_check` markers.

- `rust_ext`: the test needs the `minisgl_cpu` PyO3 extension (the bindings are for tests and
  benchmarks only; the runtime never loads them). With the extension, `rust_hotpath` is
  registered as a scheduler backend of the test process before the test sets up; without it
  the test fails, loudly, with how to build it or deselect it (`-m "not rust_ext"`); it is
  never skipped.
- `suite_check`: a test that runs the whole suite in a child (minutes); deselected unless
  `--run-suite-check` (the P1-012 gate passes it).
"""

from __future__ import annotations

import importlib.util

import pytest

EXTENSION = "minisgl_cpu"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-suite-check",
        action="store_true",
        help="run the `suite_check` tests (the whole suite again in a child process)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-suite-check"):
        return
    kept = [i for i in items if i.get_closest_marker("suite_check") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


def _extension_missing() -> bool:
    try:
        return importlib.util.find_spec(EXTENSION) is None
    except ImportError:
        return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("rust_ext") is not None and not _extension_missing():
        from minisgl.testing import rust_hotpath

        rust_hotpath.register()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> None:
    if pyfuncitem.get_closest_marker("rust_ext") is not None and _extension_missing():
        pytest.fail(
            f"{pyfuncitem.nodeid} needs the {EXTENSION} extension (build it: `maturin develop "
            "-m rust/minisgl-cpu-py/Cargo.toml`, or `nox -s tests`), or deselect the "
            "binding tests with -m 'not rust_ext'",
            pytrace=False,
        )
