"""P1-012: the runtime has no in-process PyO3 path.

The runtime switch (`MINISGL_CPU_BACKEND`) is `python | rust_service`; nothing the runtime
imports or runs reaches the `minisgl_cpu` extension, which only tests and benchmarks load,
through `minisgl.testing.rust_hotpath`. The whole suite passes without the extension: `nox -s
tests` runs it first with the extension uninstalled, and `test_full_suite_without_extension`
(opt-in: `--run-suite-check`, the card's gate passes it) runs it with the import blocked.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "packages" / "minisgl" / "src" / "minisgl"
BENCH_SRC = ROOT / "packages" / "minisgl-bench" / "src" / "minisgl"  # minisgl.testing's
EXTENSION = "minisgl_cpu"
TEST_ONLY_OWNER = BENCH_SRC / "testing" / "rust_hotpath.py"  # the one module that may import it

# Installed first in a child: records and refuses every import of the extension, as if it
# were not installed (`ModuleNotFoundError`, what a missing wheel raises).
BLOCKER = textwrap.dedent(
    f"""
    import sys, importlib.abc
    ATTEMPTS = []
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == {EXTENSION!r} or name.startswith({EXTENSION!r} + "."):
                ATTEMPTS.append(name)
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None
    sys.meta_path.insert(0, _Block())
    """
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from minisgl.testing.tiny_models import write_tiny_model

    return write_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"), seed=0)


def _child(body: str, *, env: dict[str, str] | None = None, timeout: float = 240) -> dict:
    """Run `body` after the blocker in a fresh interpreter; it prints one JSON line last."""
    code = BLOCKER + textwrap.dedent(body)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MINISGL_CPU_BACKEND")}
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.card("P1-012", "rust-hotpath-backend-removed-from-the-runtime-switch")
@pytest.mark.card("P1-012", "failing-tests-the-runtime-switch-and-the-runtime-s-imports")
def test_runtime_switch_is_python_or_service() -> None:
    out = _child(
        """
        import json
        from minisgl.scheduler import cpu_backend, factory
        from minisgl.scheduler.backend import SchedulerConfig
        cfg = SchedulerConfig(num_pages=64, page_size=1, max_seq_len=64,
                              max_running_requests=4, max_extend_tokens=64)
        errors = {}
        for name in ("rust_hotpath", "rust", "rust-hotpath"):
            try:
                factory.make_scheduler(cfg, name)
                errors[name] = None
            except ValueError as e:
                errors[name] = str(e)
        print(json.dumps({"available": list(factory.available_backends()),
                          "builtin": list(cpu_backend.BACKENDS), "errors": errors}))
        """
    )
    assert out["available"] == ["python"]
    assert out["builtin"] == ["python"]
    for name, err in out["errors"].items():
        assert err is not None, f"{name!r} still builds a scheduler in the runtime"
        assert "python" in err and "rust_service" in err, err


@pytest.mark.card("P1-012", "rust-hotpath-backend-removed-from-the-runtime-switch")
def test_server_refuses_rust_hotpath_with_the_choices() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINISGL_CPU_BACKEND")}
    env["MINISGL_CPU_BACKEND"] = "rust_hotpath"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "minisgl", "--sim-device", "0.1,0.001", "--port", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("the server started (and served) with rust_hotpath") from None
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "MINISGL_CPU_BACKEND='rust_hotpath': expected one of python, rust_service" in (
        proc.stderr
    ), proc.stderr[-2000:]


def _imports_extension(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names = [str(node.args[0].value)]
        if any(n == EXTENSION or n.startswith(EXTENSION + ".") for n in names):
            lines.append(node.lineno)
    return lines


@pytest.mark.card("P1-012", "runtime-imports-no-pyo3-module")
@pytest.mark.card("P1-012", "failing-tests-the-runtime-switch-and-the-runtime-s-imports")
def test_only_the_test_module_imports_the_extension() -> None:
    offenders = {
        f"{p.relative_to(ROOT)}:{line}"
        for p in sorted([*SRC.rglob("*.py"), *BENCH_SRC.rglob("*.py")])
        if p != TEST_ONLY_OWNER
        for line in _imports_extension(p)
    }
    assert not offenders, f"imports of {EXTENSION} outside {TEST_ONLY_OWNER.name}: {offenders}"
    assert _imports_extension(TEST_ONLY_OWNER), "the test-only owner must exist and import it"


@pytest.mark.card("P1-012", "runtime-imports-no-pyo3-module")
@pytest.mark.card("P1-012", "failing-tests-the-runtime-switch-and-the-runtime-s-imports")
@pytest.mark.parametrize("shadow", ["0", "1"])
def test_runtime_runs_and_imports_without_the_extension(tiny_llama, shadow: str) -> None:
    """Import every runtime module, generate, read the counters: the extension is never
    asked for (with shadow mode on, there is no in-process partner to shadow with)."""
    model = tiny_llama
    out = _child(
        f"""
        import importlib, json, pkgutil
        import minisgl
        skipped = ("minisgl.testing", "minisgl.__main__")
        modules = [m.name for m in pkgutil.walk_packages(minisgl.__path__, "minisgl.")
                   if not m.name.startswith(skipped)]
        for name in modules:
            importlib.import_module(name)
        from minisgl import LLM, SamplingParams
        from minisgl.scheduler import cpu_backend
        llm = LLM({str(model)!r}, device="cpu", dtype="float32")
        outs = llm.generate(["hello there", "one two three"],
                            SamplingParams(temperature=0.0, max_tokens=6))
        stats = cpu_backend.stats()
        maps = open("/proc/self/maps").read()
        print(json.dumps({{"modules": len(modules), "attempts": ATTEMPTS,
                          "backend": llm.scheduler.backend,
                          "tokens": [len(o["token_ids"]) for o in outs],
                          "mapped": {EXTENSION!r} in maps, "stats": stats}}))
        """,
        env={"MINISGL_CPU_BACKEND_SHADOW": shadow},
    )
    assert out["modules"] > 20
    assert out["attempts"] == [], f"the runtime asked for {EXTENSION}: {out['attempts']}"
    assert out["mapped"] is False
    assert out["backend"] == "python"
    assert out["tokens"] == [6, 6]
    assert "extension_available" not in out["stats"]


@pytest.mark.card("P1-012", "full-test-suite-passes-without-the-pyo3-extension-installed")
@pytest.mark.suite_check
def test_full_suite_without_extension(tmp_path: Path) -> None:
    """The whole suite (minus the `rust_ext` tests of the bindings themselves) in a child
    pytest where every process it starts finds no `minisgl_cpu` (a `sitecustomize` blocker
    on PYTHONPATH reaches server and worker subprocesses too)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINISGL_CPU_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    probe = subprocess.run(
        [sys.executable, "-c", f"import {EXTENSION}"], env=env, capture_output=True, text=True
    )
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, probe.stderr
    report = tmp_path / "junit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "not rust_ext", "-n", "auto", "-q",
         "-p", "no:randomly", "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000,
    )  # fmt: skip
    tail = proc.stdout[-6000:]
    assert proc.returncode == 0, f"suite without {EXTENSION} failed:\n{tail}"
    assert " passed" in tail and " failed" not in tail and " error" not in tail, tail


@pytest.mark.card(
    "P1-012", "the-runtime-switch-is-python-or-rust-service-and-never-reaches-the-extension"
)
def test_green_switch_and_imports(tiny_llama) -> None:
    """The Green item: both properties at once, on the default backend."""
    test_runtime_switch_is_python_or_service()
    test_runtime_runs_and_imports_without_the_extension(tiny_llama, "0")


@pytest.mark.card(
    "P1-012", "bindings-kept-only-for-tests-and-benchmarks-behind-one-test-only-module"
)
@pytest.mark.rust_ext
def test_test_only_module_registers_the_rust_scheduler(tiny_llama, monkeypatch) -> None:
    from minisgl import LLM, SamplingParams
    from minisgl.scheduler import factory
    from minisgl.testing import rust_hotpath

    rust_hotpath.register()
    rust_hotpath.register()  # idempotent
    assert "rust_hotpath" in factory.available_backends()
    model = tiny_llama
    prompts = ["the cat sat", "a b c d e f", "the cat sat on"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    tokens = {}
    for backend in ("python", "rust_hotpath"):
        monkeypatch.setenv("MINISGL_CPU_BACKEND", backend)
        llm = LLM(str(model), device="cpu", dtype="float32")
        assert llm.scheduler.backend == backend
        tokens[backend] = [o["token_ids"] for o in llm.generate(prompts, params)]
    assert tokens["python"] == tokens["rust_hotpath"]


@pytest.mark.card(
    "P1-012", "tests-that-need-the-extension-are-marked-and-fail-loudly-when-it-is-missing"
)
def test_rust_ext_tests_fail_loudly_without_the_extension(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER, encoding="utf-8")
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.rust_ext\ndef test_needs():\n    import minisgl_cpu\n\n"
        "def test_plain():\n    assert True\n",
        encoding="utf-8",
    )
    env = dict(os.environ, PYTHONPATH=str(site))
    conftest = ROOT / "conftest.py"
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
            f"--rootdir={ROOT}", "-c", str(ROOT / "pyproject.toml"),
            "-p", "conftest", str(tests)]  # fmt: skip
    env["PYTHONPATH"] += os.pathsep + str(conftest.parent)
    loud = subprocess.run(args, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert loud.returncode == 1, loud.stdout[-3000:]
    assert "needs the minisgl_cpu extension" in loud.stdout, loud.stdout[-3000:]
    assert "1 failed, 1 passed" in loud.stdout, loud.stdout[-3000:]
    quiet = subprocess.run(
        [*args, "-m", "not rust_ext"], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert quiet.returncode == 0, quiet.stdout[-3000:]
    assert "1 passed, 1 deselected" in quiet.stdout, quiet.stdout[-3000:]
