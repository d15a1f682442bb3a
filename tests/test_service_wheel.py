"""The service binary as a wheel (issue 41): maturin (`bindings = "bin"`) builds
`minisgl_cpu_service-<version>-py3-none-manylinux_2_<glibc>_<arch>.whl` carrying
`minisgl-cpu-service` as a script; installed into a fresh venv with the runtime's own wheel, the
runtime finds it in that venv's scripts dir and `MINISGL_CPU_BACKEND=rust_service python -m
minisgl` serves the openai client.

No network: both wheels are built here (maturin reuses rust/target, or $CARGO_TARGET_DIR, so it
is incremental) and installed with `pip --no-index --no-deps`; the runtime's dependencies (torch,
transformers, fastapi, ...) come from this interpreter's site-packages through a `.pth` line, as
a wheel cache would supply them."""

from __future__ import annotations

import base64
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import psutil
import pytest

from minisgl.testing.server import running_server
from minisgl.testing.tiny_models import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
SERVICE = ROOT / "rust" / "minisgl-cpu-service"
RUNTIME = ROOT / "packages" / "minisgl"
BINARY = "minisgl-cpu-service"


def workspace_version() -> str:
    cargo = tomllib.loads((ROOT / "rust" / "Cargo.toml").read_text())
    return cargo["workspace"]["package"]["version"]


def test_the_rust_extra_pins_the_service_wheel_of_this_workspace():
    service = tomllib.loads((SERVICE / "pyproject.toml").read_text())
    runtime = tomllib.loads((RUNTIME / "pyproject.toml").read_text())
    assert service["project"]["name"] == BINARY
    assert service["tool"]["maturin"]["bindings"] == "bin"
    assert service["project"]["dynamic"] == ["version"]  # taken from Cargo.toml
    extras = runtime["project"]["optional-dependencies"]
    assert extras["rust"] == [f"{BINARY}=={workspace_version()}"]


def maturin() -> list[str]:
    found = shutil.which("maturin")
    if found:
        return [found]
    pytest.fail("maturin is needed to build the service wheel (`pip install 'maturin>=1.5,<2'`)")


def run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def service_wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("service-wheel")
    env = {**os.environ}
    env.setdefault("CARGO_TARGET_DIR", str(ROOT / "rust" / "target"))
    run([*maturin(), "build", "--release", "-m", SERVICE / "Cargo.toml", "--out", out], env=env)
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def venv(tmp_path_factory, service_wheel) -> Path:
    """A fresh venv with the runtime's wheel and the service wheel installed, nothing else."""
    root = tmp_path_factory.mktemp("fresh")
    venv = root / "venv"
    run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
                   .stdout.strip())  # fmt: skip
    source = root / "minisgl-src"  # setuptools writes build/ and egg-info/ next to the sources
    skip = shutil.ignore_patterns("__pycache__", "tests", "*.egg-info", "build")
    shutil.copytree(RUNTIME, source, ignore=skip)
    build = "import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))"
    name = run([sys.executable, "-c", build, root], cwd=source).stdout.split()[-1]
    runtime_wheel = root / name
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    alone = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no checkout's minisgl
    run([*pip, "install", "--no-deps", "--no-index", runtime_wheel, service_wheel], env=alone)
    # after the install: pip would take this interpreter's minisgl (an editable install of a
    # checkout) as already satisfied; the venv's own site-packages stay first on sys.path
    ours = dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib"))
    (purelib / "zz_test_dependencies.pth").write_text("".join(f"{p}\n" for p in ours))
    return venv


def test_the_wheel_is_a_platform_wheel_without_python_abi(service_wheel):
    tag = rf"py3-none-manylinux_2_\d+_{re.escape(platform.machine())}"
    assert re.fullmatch(rf"minisgl_cpu_service-{workspace_version()}-{tag}\.whl",
                        service_wheel.name)  # fmt: skip
    with zipfile.ZipFile(service_wheel) as whl:
        record = whl.read(f"minisgl_cpu_service-{workspace_version()}.dist-info/RECORD").decode()
        scripts = [ln for ln in record.splitlines() if ".data/scripts/" in ln]
        assert [s.split(",")[0] for s in scripts] == [
            f"minisgl_cpu_service-{workspace_version()}.data/scripts/{BINARY}"
        ]
        assert not [n for n in whl.namelist() if n.endswith((".py", ".so"))]  # no module


def test_the_installed_binary_runs_from_the_venv_scripts_dir(venv, service_wheel):
    installed = venv / "bin" / BINARY
    with zipfile.ZipFile(service_wheel) as whl:
        record = whl.read(f"minisgl_cpu_service-{workspace_version()}.dist-info/RECORD").decode()
    line = next(ln for ln in record.splitlines() if ln.split(",")[0].endswith(f"scripts/{BINARY}"))
    digest = base64.urlsafe_b64encode(hashlib.sha256(installed.read_bytes()).digest())
    assert line.split(",")[1] == "sha256=" + digest.decode().rstrip("=")
    proc = subprocess.run([installed, "--help"], capture_output=True, text=True)
    assert proc.returncode == 2  # usage on stderr, as for any unknown command
    assert f"usage: {BINARY} serve --ipc-dir DIR --model-path DIR" in proc.stderr
    assert f"{BINARY} replay --input W.json --output R.json" in proc.stderr


def without_venvs_on_path() -> str:
    """PATH without any venv's bin dir (this one's included): only the scripts-dir step of the
    lookup can find the installed binary."""
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(d for d in dirs if not (Path(d) / BINARY).exists())


def test_the_installed_runtime_finds_the_binary_in_its_scripts_dir(venv, monkeypatch):
    monkeypatch.delenv("MINISGL_CPU_SERVICE_BIN", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv("PATH", without_venvs_on_path())
    code = "import minisgl.cpu_service as s; print(s.__file__); print(s.service_binary())"
    out = run([venv / "bin" / "python", "-c", code], cwd=venv.parent).stdout.split()
    assert Path(out[0]).is_relative_to(venv)  # the runtime from its wheel, not this checkout
    assert out[1] == str(venv / "bin" / BINARY)


def test_rust_service_from_the_installed_wheels_serves_the_openai_client(
    venv, tmp_path, monkeypatch
):
    from openai import OpenAI

    monkeypatch.delenv("MINISGL_CPU_SERVICE_BIN", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv("PATH", without_venvs_on_path())
    monkeypatch.chdir(tmp_path)  # nothing of this checkout on sys.path
    model = write_tiny_model("llama", tmp_path / "tiny-llama", seed=0)
    env = {"MINISGL_CPU_BACKEND": "rust_service"}
    python = str(venv / "bin" / "python")
    with running_server(model, log_dir=tmp_path, env=env, python=python) as server:
        services = [p for p in server.children if p.name() == BINARY]
        assert [p.exe() for p in services] == [str(venv / "bin" / BINARY)], server.log()
        client = OpenAI(base_url=server.base_url + "/v1", api_key="none")
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=4,
            temperature=0,
        )
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 4
        assert psutil.Process(server.proc.pid).cmdline()[:3] == [python, "-m", "minisgl"]
