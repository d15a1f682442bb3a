"""What ran besides the tests, taken in every pytest process of a gate run: the plugins and
conftest files that could rewrite a result, fixtures that replace cardgate's, the repository
modules imported (the gate checks git holds them), the interpreter and its environment, and
each bound test's source hash (a red record keeps them).

A plugin is *allowed* when it is pytest's own, cardgate's, installed in the interpreter (an
entry-point plugin such as xdist or hypothesis whose distribution lies in the interpreter's
folders: recorded with it; a dist-info found elsewhere is not installed), or declared in
the ini option `cardgate_plugins` (a module name or a repo-relative conftest path). A repo
conftest that implements no `REPORT_HOOKS` needs no declaration; a module from outside the
repository always does.

Every `.pth` file of the interpreter's site-packages is listed (`pth_files`): the paths it adds,
whether it runs code at start-up, and the distribution whose RECORD names it. One that runs code
and belongs to no distribution fails the gate (it can patch anything before a test runs).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import site
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from cardgate.redact import redact

INI_PLUGINS = "cardgate_plugins"
REPORT_HOOKS = (
    "pytest_runtest_protocol",
    "pytest_runtest_setup",
    "pytest_runtest_call",
    "pytest_runtest_teardown",
    "pytest_runtest_makereport",
    "pytest_runtest_logreport",
    "pytest_pyfunc_call",
)
CARDGATE_FIXTURES = ("metric", "parity", "release_gate")
FIXTURES_MODULE = "cardgate.fixtures"
EXECNET_MODULES = frozenset({"__channelexec__"})


def _installed_dirs() -> list[Path]:
    """The interpreter's own folders (its prefix, stdlib and site-packages)."""
    dirs = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    dirs.update(site.getsitepackages())
    dirs.update({sys.prefix, sys.base_prefix, sys.exec_prefix})
    return [Path(d).resolve() for d in dirs if d]


def _module_of(plugin: object) -> tuple[str, str | None]:
    if isinstance(plugin, ModuleType):
        return plugin.__name__, getattr(plugin, "__file__", None)
    # an instance is its class's module's; a class registered as a plugin, its own module's
    name = plugin.__module__ if isinstance(plugin, type) else type(plugin).__module__
    module = sys.modules.get(name)
    return name, getattr(module, "__file__", None) if module is not None else None


def plugins(config: pytest.Config, root: Path) -> list[dict[str, Any]]:
    """Every plugin that is not pytest's own, with the report hooks it implements."""
    declared = set(config.getini(INI_PLUGINS) or [])
    installed = _installed_dirs()
    dists = {
        id(plugin): f"{dist.project_name}=={dist.version}"
        for plugin, dist in config.pluginmanager.list_plugin_distinfo()
        if _dist_installed(dist, installed)
    }
    out: dict[str, dict[str, Any]] = {}
    for _, plugin in config.pluginmanager.list_name_plugin():
        if plugin is None:
            continue
        module, file = _module_of(plugin)
        if module.split(".")[0] in {"_pytest", "pytest", "pluggy"}:
            continue
        hooks = sorted(h for h in REPORT_HOOKS if callable(getattr(plugin, h, None)))
        path = Path(file).resolve() if file else None
        if module in EXECNET_MODULES and id(plugin) not in dists and file is None:
            origin, allowed, name = "installed", True, module  # xdist's channel to a worker
        elif module == "cardgate" or module.startswith("cardgate."):
            origin, allowed, name = "cardgate", True, module
        elif id(plugin) in dists or (
            path is not None and any(path.is_relative_to(d) for d in installed)
        ):
            origin, allowed, name = "installed", True, module  # a venv may live in the repo
        elif path is not None and path.is_relative_to(root.resolve()):
            rel = path.relative_to(root.resolve()).as_posix()
            name = rel if path.name == "conftest.py" else module
            origin = "repo"
            allowed = not hooks or name in declared or module in declared
        else:
            origin, name = "outside", module
            allowed = name in declared
        entry = out.setdefault(
            name,
            {
                "name": name,
                "origin": origin,
                "file": redact(str(path), root) if path else None,
                "dist": dists.get(id(plugin)),
                "hooks": [],
                "allowed": allowed,
            },
        )
        entry["hooks"] = sorted(set(entry["hooks"]) | set(hooks))
        entry["allowed"] = entry["allowed"] and allowed
    return sorted(out.values(), key=lambda e: e["name"])


def _dist_installed(dist: Any, installed: list[Path]) -> bool:
    """A distribution whose metadata lies in the interpreter's folders (not on PYTHONPATH)."""
    try:
        where = Path(str(dist.locate_file(""))).resolve()
    except Exception:
        return False
    return any(where.is_relative_to(d) for d in installed)


def _recorded_by(site_dir: Path) -> dict[str, str]:
    """file name -> "dist==version" for every file a distribution's RECORD names."""
    out: dict[str, str] = {}
    for record in sorted(site_dir.glob("*.dist-info/RECORD")):
        meta = record.parent / "METADATA"
        name = version = ""
        try:
            for line in meta.read_text(encoding="utf-8", errors="replace").splitlines():
                if line.startswith("Name:") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("Version:") and not version:
                    version = line.split(":", 1)[1].strip()
            rows = record.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        for row in rows:
            out.setdefault(row.split(",", 1)[0], f"{name}=={version}")
    return out


def pth_files(site_dirs: Iterable[Path], root: Path) -> list[dict[str, Any]]:
    """Every `.pth` file of these folders: the paths it adds, whether a line runs code (Python
    executes lines that start with `import`), and the distribution that installed it."""
    out: list[dict[str, Any]] = []
    for site_dir in site_dirs:
        if not site_dir.is_dir():
            continue
        owners = _recorded_by(site_dir)
        for pth in sorted(site_dir.glob("*.pth")):
            try:
                lines = pth.read_text(encoding="utf-8", errors="replace").splitlines()
            except OSError:
                continue
            code = [ln for ln in lines if ln.startswith(("import ", "import\t"))]
            paths = [
                ln.strip() for ln in lines if ln.strip() and not ln.startswith(("#", "import"))
            ]
            out.append(
                {
                    "file": pth.name,
                    "dir": redact(str(site_dir), root),
                    "code": bool(code),
                    "paths": [redact(p, root) for p in paths],
                    "dist": owners.get(pth.name),
                }
            )
    return out


def site_dirs() -> list[Path]:
    dirs = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    dirs.update(site.getsitepackages())
    return sorted(Path(d) for d in dirs if d)


_NOT_SOURCE = {"site-packages", "node_modules", "target", "__pycache__"}


def _room_files(room: Path) -> tuple[dict[str, str], dict[str, set[str]]]:
    """The room's Python files by every '/'-suffix of their path (suffix -> room-relative
    path), and each package folder's name -> the room-relative folders above such packages."""
    by_suffix: dict[str, str] = {}
    packages: dict[str, set[str]] = {}
    for folder, dirs, files in os.walk(room):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in _NOT_SOURCE]
        rel_dir = Path(folder).relative_to(room)
        for name in files:
            if not name.endswith(".py"):
                continue
            parts = (*rel_dir.parts, name)
            rel = "/".join(parts)
            for i in range(len(parts)):
                by_suffix.setdefault("/".join(parts[i:]), rel)
            if name == "__init__.py" and rel_dir.parts:
                packages.setdefault(rel_dir.parts[-1], set()).add(rel_dir.parent.as_posix())
    return by_suffix, packages


def shadowed_modules(room: Path | None) -> list[str]:
    """Room-relative files of modules that the commit holds (or that belong to one of its
    packages) but were imported from outside the room and outside the interpreter's folders:
    an editable install pointing at another checkout runs that checkout's code, which the
    room's redirect of its own working tree does not catch. The gate's own package excepted
    (it runs as installed)."""
    if room is None:
        return []
    base = room.resolve()
    installed = _installed_dirs()
    by_suffix, packages = _room_files(base)
    found: set[str] = set()
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if (
            not isinstance(file, str)
            or not os.path.isabs(file)
            or name.split(".")[0]
            in (
                "cardgate",
                "__main__",
            )
        ):
            continue
        path = Path(file).resolve()
        if path.is_relative_to(base) or any(path.is_relative_to(d) for d in installed):
            continue
        parts = name.split(".")
        rel = "/".join(parts) + ("/__init__.py" if path.name == "__init__.py" else ".py")
        if not path.as_posix().endswith("/" + rel):
            continue  # not laid out as its dotted name (a loader's own module)
        if rel in by_suffix:
            found.add(by_suffix[rel])
        elif parts[0] in packages and len(parts) > 1:
            above = sorted(packages[parts[0]])[0]
            found.add(rel if above == "." else f"{above}/{rel}")
    return sorted(found)


def worktree_modules(source: Path | None) -> list[str]:
    """Modules imported from the working tree the room was made from (an editable install the
    room could not redirect), relative to it; the gate's own package and the interpreter's
    folders (a virtualenv in the repository) excepted."""
    if source is None:
        return []
    base = source.resolve()
    installed = _installed_dirs()
    found: set[str] = set()
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or name == "cardgate" or name.startswith("cardgate."):
            continue
        path = Path(file).resolve()
        if not path.is_relative_to(base) or any(path.is_relative_to(d) for d in installed):
            continue
        found.add(path.relative_to(base).as_posix())
    return sorted(found)


def fixture_overrides(items: Iterable[pytest.Item], root: Path) -> list[dict[str, str]]:
    """cardgate fixtures (`metric`, ...) that a test gets from somewhere else."""
    found: dict[tuple[str, str], dict[str, str]] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)  # pytest's resolved fixture closure
        defs_by_name = getattr(info, "name2fixturedefs", {}) or {}
        for name in CARDGATE_FIXTURES:
            defs = defs_by_name.get(name)
            if not defs:
                continue
            func = defs[-1].func
            if getattr(func, "__module__", "") == FIXTURES_MODULE:
                continue
            try:
                where = redact(inspect.getsourcefile(func) or "?", root)
            except TypeError:
                where = "?"
            found[(name, where)] = {"fixture": name, "where": where.removeprefix("./")}
    return sorted(found.values(), key=lambda e: (e["fixture"], e["where"]))


def repo_modules(root: Path) -> tuple[list[str], list[str]]:
    """(repo-relative files of imported modules, those that resolve outside the root); files
    of the interpreter's own folders (a virtualenv inside the repo) are not the repo's."""
    base = Path(os.path.abspath(root))
    real = base.resolve()
    installed = _installed_dirs()
    inside: set[str] = set()
    outside: set[str] = set()
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or not os.path.isabs(file):  # torch's `_ops.py`: no file
            continue
        path = Path(os.path.normpath(file))
        if not path.is_relative_to(base) and not path.is_relative_to(real):
            continue
        if any(path.resolve().is_relative_to(d) for d in installed):  # a virtualenv in the repo
            continue
        rel = path.relative_to(base if path.is_relative_to(base) else real).as_posix()
        if "/__pycache__/" in f"/{rel}":
            continue
        inside.add(rel)
        if not path.resolve().is_relative_to(real):
            outside.add(rel)
    return sorted(inside), sorted(outside)


def _foreign(module: str) -> str | None:
    """The file of `sitecustomize` / `usercustomize` when it comes from outside the
    interpreter's own prefixes (it runs before any test and can change any result). A link
    placed in the interpreter's own folders (a distribution's) is the interpreter's."""
    loaded = sys.modules.get(module)
    file = getattr(loaded, "__file__", None)
    if not file:
        return None
    found = Path(os.path.abspath(file))
    path = found.resolve()
    prefixes = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    if any(path.is_relative_to(p) for p in prefixes):
        return None
    # a distribution's own link (Debian's lib/python3.X/sitecustomize.py -> /etc/python3.X/):
    # the file itself lies in the interpreter's folders, only its target outside
    if found.is_symlink() and any(found.parent.resolve().is_relative_to(p) for p in prefixes):
        return None
    return str(path)


def environment(root: Path) -> dict[str, Any]:
    """The interpreter, PATH, PYTHONPATH and start-up customisations, without private paths."""
    site_file = getattr(sys.modules.get("sitecustomize"), "__file__", None)
    user_file = getattr(sys.modules.get("usercustomize"), "__file__", None)
    foreign = [f for f in (_foreign("sitecustomize"), _foreign("usercustomize")) if f]
    return {
        "python": redact(sys.executable, root),
        "PATH": redact(os.environ.get("PATH", ""), root),
        "PYTHONPATH": redact(os.environ.get("PYTHONPATH", ""), root),
        "sitecustomize": redact(site_file, root) if site_file else "",
        "usercustomize": redact(user_file, root) if user_file else "",
        "foreign_startup": [redact(f, root) for f in foreign],
        "pth": pth_files(site_dirs(), root),
    }


def source_sha256(item: pytest.Item) -> str | None:
    """sha256 of the test function's source (None for items that are not Python functions)."""
    obj = getattr(item, "obj", None)
    try:
        source = inspect.getsource(obj) if obj is not None else None
    except (OSError, TypeError):
        source = None
    return hashlib.sha256(source.encode()).hexdigest() if source else None
