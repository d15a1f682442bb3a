"""A lean runtime (issue 41 item 2): the wheel of `packages/minisgl` holds what serving needs, no
`minisgl/benchmark` or `minisgl/testing`, and none of its modules imports `cardgate` (nor does
its metadata ask for it). The benchmarks, the release gate and the test helpers are the wheel of
`packages/minisgl-bench`, under the same import names, needing `minisgl` and `pytest-cardgate`.

No network: both wheels are built here with setuptools from copies of their sources, and
installed with `pip --no-index --no-deps` into a fresh venv whose dependencies (torch, ...) come
from this interpreter's site-packages through a `.pth` line."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "packages" / "minisgl"
BENCH = ROOT / "packages" / "minisgl-bench"
CARDGATE = ROOT / "packages" / "cardgate"
MOVED = ("minisgl/benchmark/", "minisgl/testing/")
BUILD = "import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))"


def run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def build_wheel(project: Path, out: Path) -> Path:
    """The wheel of `project`, built from a copy (setuptools writes build/ next to sources)."""
    assert (project / "pyproject.toml").is_file(), f"no distribution at {project}"
    source = out / "src-copy"
    skip = shutil.ignore_patterns("__pycache__", "tests", "*.egg-info", "build")
    shutil.copytree(project, source, ignore=skip)
    name = run([sys.executable, "-c", BUILD, out], cwd=source).stdout.split()[-1]
    return out / name


@pytest.fixture(scope="module")
def runtime_wheel(tmp_path_factory) -> Path:
    return build_wheel(RUNTIME, tmp_path_factory.mktemp("runtime-wheel"))


@pytest.fixture(scope="module")
def bench_wheel(tmp_path_factory) -> Path:
    return build_wheel(BENCH, tmp_path_factory.mktemp("bench-wheel"))


def files(wheel: Path) -> list[str]:
    """The wheel's files, its .dist-info left out."""
    with zipfile.ZipFile(wheel) as whl:
        return [n for n in whl.namelist() if ".dist-info/" not in n]


def requires(wheel: Path) -> list[str]:
    """The wheel's `Requires-Dist` lines, extras' included."""
    with zipfile.ZipFile(wheel) as whl:
        (meta,) = (n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(whl.read(meta).decode()).get_all("Requires-Dist") or []


def imported(source: str) -> set[str]:
    """Every module name a source imports, lazy imports inside functions included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def distribution(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_runtime_wheel_holds_no_benchmark_or_testing(runtime_wheel):
    names = files(runtime_wheel)
    assert {"minisgl/__init__.py", "minisgl/server/launch.py", "minisgl/llm.py"} <= set(names)
    assert [n for n in names if n.startswith(MOVED)] == []


def test_no_module_of_the_runtime_wheel_imports_cardgate_or_the_bench(runtime_wheel):
    wrong: dict[str, list[str]] = {}
    with zipfile.ZipFile(runtime_wheel) as whl:
        for name in (n for n in files(runtime_wheel) if n.endswith(".py")):
            found = {
                m
                for m in imported(whl.read(name).decode())
                if m.split(".")[0] == "cardgate"
                or m.startswith(("minisgl.benchmark", "minisgl.testing"))
            }
            if found:
                wrong[name] = sorted(found)
    assert wrong == {}


def test_the_runtime_metadata_needs_no_cardgate_nor_the_bench(runtime_wheel):
    names = {distribution(r) for r in requires(runtime_wheel)}
    assert "torch" in names
    assert names.isdisjoint({"pytest-cardgate", "cardgate", "minisgl-bench"})


def test_the_bench_wheel_holds_the_benchmarks_and_test_helpers_and_needs_the_runtime(bench_wheel):
    names = files(bench_wheel)
    assert {n.split("/")[1] for n in names} == {"benchmark", "testing"}
    assert {"minisgl/benchmark/harness.py", "minisgl/benchmark/workloads/plain.json",
            "minisgl/testing/server.py"} <= set(names)  # fmt: skip
    assert "minisgl/__init__.py" not in names  # the runtime's, never overwritten
    assert {"minisgl", "pytest-cardgate"} <= {distribution(r) for r in requires(bench_wheel)}


@pytest.fixture(scope="module")
def venv(tmp_path_factory, runtime_wheel, bench_wheel) -> Path:
    """A fresh venv with the runtime, the bench and pytest-cardgate (the bench's dependency that
    this interpreter has as an editable install) installed from their wheels; the other
    dependencies come from this interpreter."""
    cardgate_wheel = build_wheel(CARDGATE, tmp_path_factory.mktemp("cardgate-wheel"))
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    alone = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no checkout's minisgl
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    wheels = [runtime_wheel, bench_wheel, cardgate_wheel]
    run([*pip, "install", "--no-deps", "--no-index", *wheels], env=alone)
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    ours = dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib"))
    (Path(purelib.stdout.strip()) / "zz_test_dependencies.pth").write_text(
        "".join(f"{p}\n" for p in ours)
    )
    return venv


def test_the_benchmark_commands_run_from_the_installed_wheels(venv, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    python = venv / "bin" / "python"
    code = "import minisgl.benchmark.harness as h, minisgl.testing.server as s; print(h.__file__)"
    out = run([python, "-c", code], cwd=tmp_path, env=env).stdout.split()
    assert Path(out[-1]).is_relative_to(venv)  # the bench from its wheel, not this checkout
    usage = run([python, "-m", "minisgl.benchmark.harness", "--help"], cwd=tmp_path, env=env)
    assert "offline" in usage.stdout and "online" in usage.stdout


# imported by the bench without being its dependency or the runtime's: module -> why
BENCH_OPTIONAL = {
    "llama_cpp": "the llama.cpp arm, minisgl-bench[llamacpp], opt-in",
    "vllm": "the vLLM CPU arm, in a virtualenv of its own (nox -s vllm), opt-in",
    "minisgl_cpu": "the PyO3 extension (rust/minisgl-cpu-py), tests and benchmarks only",
    "triton": "CUDA only, comes with torch's Linux wheels",
    "tokenizers": "transformers' dependency",
}
IMPORT_NAMES = {"cardgate": "pytest-cardgate", "yaml": "pyyaml", "zmq": "pyzmq"}


def test_the_bench_declares_what_it_imports():
    def deps(project: Path) -> set[str]:
        meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
        extras = meta.get("optional-dependencies", {})
        return {distribution(d) for d in [*meta["dependencies"], *extras.get("serve", [])]}

    declared = deps(BENCH) | deps(RUNTIME)
    sources = sorted((BENCH / "src").rglob("*.py"))
    tops = {m.split(".")[0] for f in sources for m in imported(f.read_text())}
    third_party = tops - set(sys.stdlib_module_names) - {"minisgl", "__future__"}
    needed = {IMPORT_NAMES.get(t, t) for t in third_party - set(BENCH_OPTIONAL)}
    assert needed <= declared, f"undeclared: {sorted(needed - declared)}"
