"""noxfile.py's install steps, run against a stand-in session: `--install-only` (nox skips
every `session.run`, which then returns None) must still install, not fail on the build that
did not run (`nox -s tests --install-only` is how a benchmark machine gets the test venv)."""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class _Session:
    """What the install steps call; `run` does nothing and returns None, as under
    `--install-only`."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, ...]] = []
        self.installs: list[tuple[str, ...]] = []
        self.install_env: list[dict[str, str]] = []  # each install's env=
        self.logs: list[str] = []
        self.env: dict[str, str] = {}
        self.bin = "bin"

    def run(self, *args: str, **kwargs: object) -> None:
        self.runs.append(args)

    def install(self, *args: str, **kwargs: object) -> None:
        self.installs.append(args)
        self.install_env.append(dict(kwargs.get("env") or {}))  # type: ignore[call-overload]

    def log(self, msg: str) -> None:
        self.logs.append(msg)


def _noxfile(monkeypatch):
    stub = types.ModuleType("nox")
    stub.options = types.SimpleNamespace()
    stub.session = lambda *a, **k: (lambda f: f) if not (a and callable(a[0])) else a[0]
    stub.Session = _Session
    monkeypatch.setitem(sys.modules, "nox", stub)
    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_service_install_under_install_only_skips_the_wheel_it_did_not_build(
    tmp_path, monkeypatch
):
    noxfile = _noxfile(monkeypatch)
    monkeypatch.setenv("CARGO_TARGET_DIR", str(tmp_path / "target"))  # no wheel there
    session = _Session()
    noxfile.install_service(session)
    assert any(a[0] == "maturin" for a in session.runs)  # asked for, skipped by nox
    assert not [a for a in session.installs if any(str(x).endswith(".whl") for x in a)]
    assert any("install-only" in m for m in session.logs), session.logs


def test_the_service_install_installs_the_wheel_maturin_built(tmp_path, monkeypatch):
    noxfile = _noxfile(monkeypatch)
    target = tmp_path / "target"
    monkeypatch.setenv("CARGO_TARGET_DIR", str(target))
    session = _Session()
    real_run = session.run

    def run(*args: str, **kwargs: object) -> None:  # maturin "builds" its wheel
        real_run(*args, **kwargs)
        if args[0] == "maturin":
            out = Path(args[args.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "minisgl_cpu_service-0.1.0-py3-none-linux_x86_64.whl").write_bytes(b"")

    session.run = run
    noxfile.install_service(session)
    wheels = [a for a in session.installs if any(str(x).endswith(".whl") for x in a)]
    assert len(wheels) == 1 and "--force-reinstall" in wheels[0]


def test_every_file_with_isa_paths_tests_runs_again_at_every_level(monkeypatch):
    """A file whose tests are marked `isa_paths` is in each MINISGL_CPU_ISA level's list, so its
    lower paths (the C kernels' plain loops, no VNNI) run wherever CI lands: a file left out ran
    its plain loops only on a machine without AVX-512 (the SiLU quantization's scalar loop of
    `kernels/cpu/quant.c` coded gates of -90 and below as -127 there, unseen on the others)."""
    nf = _noxfile(monkeypatch)
    marked = {
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "tests").glob("test_*.py"))
        if re.search(r"^(@|pytestmark = )pytest\.mark\.isa_paths", p.read_text("utf-8"), re.M)
    }
    assert marked, "no file marks isa_paths tests"
    for level, paths in nf.ISA_PASS_TESTS.items():
        assert set(paths) == marked, (level, sorted(marked - set(paths)))


def test_the_runtime_installs_with_bytecode_and_compiles_the_packages(tmp_path, monkeypatch):
    """uv, unlike pip, installs no bytecode, and with PYTHONDONTWRITEBYTECODE set (as on the
    project's machines) every process the suite starts compiled torch's and transformers'
    sources again: `import torch` 4.2 s against 1.6 from bytecode (amd-epyc), in ~100
    of its ~490 processes a run. Every install of the runtime asks uv for bytecode, and the repository's
    own packages (editable: not uv's to compile) are compiled once after it."""
    noxfile = _noxfile(monkeypatch)
    monkeypatch.setattr(noxfile, "install_service", lambda s: None)
    monkeypatch.setattr(noxfile, "install_extension", lambda s: None)
    session = _Session()
    noxfile.install_runtime(session, extension=True)
    assert session.installs
    for args, env in zip(session.installs, session.install_env, strict=True):
        assert env.get("UV_COMPILE_BYTECODE") == "1", args
    compiles = [a for a in session.runs if a[1:3] == ("-m", "compileall")]
    assert len(compiles) == 1, session.runs
    assert {"packages/minisgl/src", "packages/minisgl-bench/src",
            "packages/cardgate/src"} <= set(compiles[0])  # fmt: skip


def test_this_interpreter_finds_torchs_bytecode_or_may_write_it():
    """What the test above arranges, seen from the suite's own interpreter: torch's modules
    load from bytecode (or Python may write it on the first import), so no process the suite
    starts compiles torch again."""
    import importlib.util

    import torch

    if not sys.flags.dont_write_bytecode:
        return  # the first import wrote what the others read
    for name in ("torch", "torch._decomp.decompositions", "torch.nn.modules.module"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        cached = importlib.util.cache_from_source(spec.origin)
        assert Path(cached).is_file(), f"{name}: no bytecode at {cached}"
    assert torch.__version__
