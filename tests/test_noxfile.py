"""noxfile.py's install steps, run against a stand-in session: `--install-only` (nox skips
every `session.run`, which then returns None) must still install, not fail on the build that
did not run (`nox -s tests --install-only` is how a benchmark machine gets the test venv)."""

from __future__ import annotations

import importlib.util
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
        self.logs: list[str] = []

    def run(self, *args: str, **kwargs: object) -> None:
        self.runs.append(args)

    def install(self, *args: str, **kwargs: object) -> None:
        self.installs.append(args)

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
