"""What a real machine's interpreter brings, seen on the first GPU gate run (an H200 image:
Ubuntu's python3.12 in a venv with pytest plugins installed): none of it is a foreign plugin or a
foreign start-up file."""

from __future__ import annotations

import collections
import sys
import types
from pathlib import Path

import pytest

from cardgate import inventory


def _interpreter_at(monkeypatch: pytest.MonkeyPatch, prefix: Path) -> None:
    for name in ("prefix", "base_prefix", "exec_prefix"):
        monkeypatch.setattr(sys, name, str(prefix))


def _startup_module(monkeypatch: pytest.MonkeyPatch, file: Path) -> None:
    module = types.ModuleType("sitecustomize")
    module.__file__ = str(file)
    monkeypatch.setitem(sys.modules, "sitecustomize", module)


def test_a_distro_sitecustomize_linked_from_the_interpreter_is_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Debian and Ubuntu ship /usr/lib/python3.X/sitecustomize.py as a link to
    /etc/python3.X/sitecustomize.py: found in the interpreter's folders, it is the
    interpreter's, wherever the link points."""
    etc = tmp_path / "etc" / "python3.12"
    etc.mkdir(parents=True)
    (etc / "sitecustomize.py").write_text("# the distribution's\n")
    lib = tmp_path / "usr" / "lib" / "python3.12"
    lib.mkdir(parents=True)
    (lib / "sitecustomize.py").symlink_to(etc / "sitecustomize.py")
    _interpreter_at(monkeypatch, tmp_path / "usr")
    _startup_module(monkeypatch, lib / "sitecustomize.py")
    assert inventory._foreign("sitecustomize") is None


def test_a_sitecustomize_from_outside_the_interpreter_is_still_foreign(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sitecustomize.py").write_text("OK = True\n")
    (tmp_path / "usr").mkdir()
    _interpreter_at(monkeypatch, tmp_path / "usr")
    _startup_module(monkeypatch, outside / "sitecustomize.py")
    assert inventory._foreign("sitecustomize") == str((outside / "sitecustomize.py").resolve())


def test_a_link_in_the_interpreter_that_leaves_it_through_a_folder_link_is_foreign(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the file itself may be the distribution's link: a folder of the path that links out
    of the interpreter (a PYTHONPATH entry placed inside it by a link) does not make it its own."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sitecustomize.py").write_text("OK = True\n")
    usr = tmp_path / "usr"
    usr.mkdir()
    (usr / "linked").symlink_to(outside, target_is_directory=True)
    _interpreter_at(monkeypatch, usr)
    _startup_module(monkeypatch, usr / "linked" / "sitecustomize.py")
    assert inventory._foreign("sitecustomize") == str((outside / "sitecustomize.py").resolve())


def test_a_plugin_registered_as_a_class_is_named_by_its_module(
    request: pytest.FixtureRequest,
) -> None:
    """A plugin may register a class (not an instance): it is the class's module's plugin, not
    one from an unknown module called `builtins` (the type of a class)."""
    manager = request.config.pluginmanager
    manager.register(collections.OrderedDict, "a-class-plugin")
    try:
        entries = inventory.plugins(request.config, Path(request.config.rootpath))
    finally:
        manager.unregister(name="a-class-plugin")
    names = {e["name"]: e for e in entries}
    assert "builtins" not in names
    assert names["collections"]["origin"] == "installed"
    assert names["collections"]["allowed"] is True
