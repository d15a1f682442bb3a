"""Layers point down (issue 36 item 5): the kernels and the step contract at the bottom, models
and attention above them, the engine, scheduler, runtime, server and benchmarks on top. Read
from the source (every import, lazy ones inside functions included), nothing is run."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl.testing.imports import cycles, imported_names, module_graph

SRC = Path(__file__).resolve().parents[1] / "src" / "minisgl"
# every distribution's sources: the runtime's, and the benchmarks' and test helpers' (issue 41)
SOURCES = sorted(Path(__file__).resolve().parents[2].glob("*/src/minisgl"))
TOOLS = ("benchmark", "testing")  # packages/minisgl-bench: on top, never imported by the runtime

# package -> the minisgl packages / modules it may import (itself always)
ALLOWED = {
    "step": set(),
    "kernels": {"utils"},
    "kvcache": {"utils", "config"},
    "attention": {"step", "kernels", "kvcache", "config", "utils"},
    "models": {"config", "distributed", "kernels", "utils"},
}


def minisgl_imports(path: Path) -> set[str]:
    """The top-level minisgl packages and modules a file imports (`minisgl.x.y` -> `x`, `from
    minisgl import x` -> `x`)."""
    return {
        parts[1]
        for parts in (name.split(".") for name in imported_names(path))
        if parts[0] == "minisgl" and len(parts) > 1
    }


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_low_layer_imports_nothing_above_it(package):
    files = sorted((SRC / package).rglob("*.py"))
    assert files, package
    wrong = {
        str(f.relative_to(SRC)): sorted(minisgl_imports(f) - ALLOWED[package] - {package})
        for f in files
    }
    assert {f: w for f, w in wrong.items() if w} == {}


def test_the_reader_sees_lazy_and_plain_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import minisgl.engine.engine\nfrom minisgl.step.plan import StepPlan\n"
        "def f():\n    from minisgl.server import args\n    import os\n"
        "from minisgl import ipc, LLM\n"
    )
    assert minisgl_imports(probe) == {"engine", "step", "server", "ipc", "LLM"}


def test_the_runtime_imports_no_benchmark_or_test_helper():
    imports = {str(f.relative_to(SRC)): minisgl_imports(f) for f in sorted(SRC.rglob("*.py"))}
    wrong = {f: sorted(found.intersection(TOOLS)) for f, found in imports.items()}
    assert {f: w for f, w in wrong.items() if w and not f.startswith(TOOLS)} == {}


def package_graph(src: Path) -> dict[str, set[str]]:
    """The top-level packages and modules of one distribution's `minisgl` (`engine`, `llm`, ...)
    -> those of them each imports, lazy imports included."""
    graph: dict[str, set[str]] = {}
    for f in sorted(src.rglob("*.py")):
        top = f.relative_to(src).parts[0].removesuffix(".py")
        graph.setdefault(top, set()).update(minisgl_imports(f))
    return {top: (found & set(graph)) - {top} for top, found in graph.items()}


def test_the_runtimes_packages_import_one_another_in_no_circle():
    """A circle of packages has no layer order: the runtime loop reaching up into the server
    (its IPC and the Rust service's process), the tokenizer worker into the server, a tensor-
    parallel rank's entry point in `distributed` building an `Engine`."""
    assert cycles(package_graph(SRC)) == []


@pytest.mark.parametrize("package", TOOLS)
def test_the_benchmarks_and_test_helpers_import_in_no_circle(package):
    graph = module_graph([src / package for src in SOURCES], f"minisgl.{package}")
    assert graph, package
    assert cycles(graph) == []


def test_the_harness_runs_the_online_benchmarks_that_no_longer_import_it():
    graph = module_graph([src / "benchmark" for src in SOURCES], "minisgl.benchmark")
    assert {"online", "online_ab"} <= graph["harness"]  # lazy imports are read too
    assert "harness" not in graph["online"] | graph["online_ab"]


def test_the_cycle_finder_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
