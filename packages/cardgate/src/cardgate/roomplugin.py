"""Loaded by the gate into its pytest child (`-p cardgate.roomplugin`), before any conftest or
test module: imports that an editable install points at the working tree (a `.pth` path entry,
a setuptools editable finder's `MAPPING`) point at the same path in the clean room instead, so
the commit's code runs and not the working tree's. The working tree comes from the gate's
`CARDGATE_ROOM_SOURCE`; the room is the current folder (the gate's `cwd`). Paths inside the
interpreter's own folders stay: a virtualenv kept in the checkout (nox's `.nox/`) is the
interpreter's, not the commit's, and the room has no copy of it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from cardgate.room import ROOM_SOURCE_ENV


def _interpreter_dirs() -> list[Path]:
    return [Path(p).resolve() for p in {sys.prefix, sys.exec_prefix} if p]


def _moved(path: str, source: Path, room: Path) -> str:
    resolved = Path(path).resolve()
    if any(resolved.is_relative_to(d) for d in _interpreter_dirs()):
        return path
    try:
        rel = resolved.relative_to(source)
    except ValueError:
        return path
    return str(room / rel)


def redirect(source: Path, room: Path) -> None:
    """Point sys.path entries and editable finders under `source` at `room`."""
    sys.path[:] = [_moved(p, source, room) if p else p for p in sys.path]
    for name, module in list(sys.modules.items()):
        if not name.startswith("__editable__"):
            continue
        mapping = getattr(module, "MAPPING", None)
        if isinstance(mapping, dict):
            for key, value in list(mapping.items()):
                mapping[key] = _moved(value, source, room)
        spaces = getattr(module, "NAMESPACES", None)
        if isinstance(spaces, dict):
            for key, value in list(spaces.items()):
                spaces[key] = [_moved(v, source, room) for v in value]


_source = os.environ.get(ROOM_SOURCE_ENV)
if _source:
    redirect(Path(_source).resolve(), Path.cwd().resolve())
