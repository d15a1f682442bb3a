"""The clean room's hole found on a real card (P3-004's red run at 26d4f9f, from a clone whose
interpreter had the runtime installed editable from another checkout): the commit's own
modules were imported from that other checkout, the room redirected nothing (it redirects only
the working tree it was made from) and the red run passed 62 of 67 tests whose module did not
exist at the commit. A module the commit holds, imported from anywhere but the room, holds the
gate."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from cardgate import inventory
from cardgate.outcome import Verdict
from cardgate.provenance import inventory_checks
from cardgate.run import Inventory


def _module(monkeypatch: pytest.MonkeyPatch, name: str, file: Path) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("X = 1\n")
    mod = types.ModuleType(name)
    mod.__file__ = str(file)
    monkeypatch.setitem(sys.modules, name, mod)


def test_a_module_of_the_commit_imported_from_another_checkout_is_shadowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    room = tmp_path / "room"
    other = tmp_path / "other-checkout"
    (room / "packages/rt/src/rtpkg").mkdir(parents=True)
    (room / "packages/rt/src/rtpkg/__init__.py").write_text("")
    (room / "packages/rt/src/rtpkg/core.py").write_text("X = 0\n")
    _module(monkeypatch, "rtpkg.core", other / "packages/rt/src/rtpkg/core.py")
    _module(monkeypatch, "rtpkg.only_there", other / "packages/rt/src/rtpkg/only_there.py")
    _module(monkeypatch, "rtpkg.inside", room / "packages/rt/src/rtpkg/inside.py")
    found = inventory.shadowed_modules(room)
    # the commit holds rtpkg/core.py (ran from elsewhere) and the package rtpkg, whose module
    # only_there.py the commit lacks (a module of the commit's package from elsewhere)
    assert found == ["packages/rt/src/rtpkg/core.py", "packages/rt/src/rtpkg/only_there.py"]


def test_installed_distributions_and_the_gate_itself_are_not_shadows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    room = tmp_path / "room"
    (room / "src/app").mkdir(parents=True)
    (room / "src/app/__init__.py").write_text("")
    _module(monkeypatch, "somedist.mod", tmp_path / "elsewhere/somedist/mod.py")  # not the room's
    assert inventory.shadowed_modules(room) == []
    assert inventory.shadowed_modules(None) == []


def test_a_shadowed_module_holds_the_gate() -> None:
    checks = inventory_checks(Inventory(shadowed_modules=("packages/rt/src/rtpkg/core.py",)))
    (check,) = [c for c in checks if c.name == "provenance"]
    assert check.status is Verdict.HOLD
    assert "packages/rt/src/rtpkg/core.py" in check.reason and "not from the clean room" in (
        check.reason
    )
