"""Repository-wide pytest hooks: the `rust_ext`, `int8_matrix_unit` and `suite_check` markers.

- `rust_ext`: the test needs the `minisgl_cpu` PyO3 extension (the bindings are for tests and
  benchmarks only; the runtime never loads them). With the extension, `rust_hotpath` is
  registered as a scheduler backend of the test process before the test sets up; without it
  the test fails, loudly, with how to build it or deselect it (`-m "not rust_ext"`); it is
  never skipped.
- `int8_matrix_unit`: the test needs W8A8's int8 GEMM (AMX-INT8 or AVX512-VNNI under the
  `MINISGL_CPU_ISA` level in force); elsewhere it skips, saying why, as missing evidence
  (`minisgl.testing.capability`): the x86-avx2 kind (an AMD EPYC without AVX-512) has neither.
- `suite_check`: a test that runs the whole suite in a child (minutes); deselected unless
  `--run-suite-check` or the gate of a card it is bound to runs it (`--cardgate-card P1-012`:
  the gate's pytest options come from the commit, not the caller).

Threads under pytest-xdist: each worker gets the cores shared out (at least one) as its torch
and OpenMP budget (`OMP_NUM_THREADS`, inherited by the servers and ranks a test starts), or
`$MINISGL_TEST_THREADS`. With every worker on all the cores, the OpenMP pools of two workers
spun against each other: `tests/test_cpu_decode_step.py` + `tests/test_w8a8.py` took 248 s at
-n 2 on 2 cores, 108 s with one thread a worker (3x less CPU time). Tests that need a thread
count set it themselves. Engines keep their threads under load (`MINISGL_CPU_THREADS_ADAPT=0`),
so two runs a test compares ran alike.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

EXTENSION = "minisgl_cpu"
THREADS_ENV = "MINISGL_TEST_THREADS"


def worker_threads() -> int | None:
    """Threads of this pytest process: $MINISGL_TEST_THREADS, else the cores shared out over
    the xdist workers (None outside xdist or with one worker: as is)."""
    if os.environ.get(THREADS_ENV):
        return max(1, int(os.environ[THREADS_ENV]))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers <= 1:
        return None
    return max(1, len(os.sched_getaffinity(0)) // workers)


def pytest_configure(config: pytest.Config) -> None:
    # engines keep the threads they are given (inherited by the servers a test starts), even
    # where a caller's environment turns the adaptation on: a test comparing two runs to the
    # bit must not see one adapt to the other workers' load (`utils/cpu_share.py`; its own tests
    # and benchmark turn it on)
    os.environ["MINISGL_CPU_THREADS_ADAPT"] = "0"
    threads = worker_threads()
    if threads is None:
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)  # a torch imported later, child processes
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-suite-check",
        action="store_true",
        help="run the `suite_check` tests (the whole suite again in a child process)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-suite-check"):
        return
    gated = _option(config, "cardgate_card")  # a card's gate runs the suite checks bound to it
    kept = [i for i in items if i.get_closest_marker("suite_check") is None or _bound(i, gated)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


def _option(config: pytest.Config, name: str) -> str | None:
    """A plugin's option, None where the plugin is not loaded."""
    try:
        return config.getoption(name)
    except ValueError:
        return None


def _bound(item: pytest.Item, card: str | None) -> bool:
    """Whether `item` is bound to `card` (a `card` marker naming it)."""
    return card is not None and any(m.args[:1] == (card,) for m in item.iter_markers("card"))


def _extension_missing() -> bool:
    try:
        return importlib.util.find_spec(EXTENSION) is None
    except ImportError:
        return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("int8_matrix_unit") is not None:
        from minisgl.testing.capability import int8_matrix_unit_missing

        why = int8_matrix_unit_missing()
        if why is not None:
            pytest.skip(why)
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
