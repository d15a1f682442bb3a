"""The clean room: a fresh checkout of the commit a gate records, read from git's raw objects.

`build_room(root, commit, dest)` writes every file of the commit's tree under `dest` from
`git --no-replace-objects cat-file --batch`: no clean or smudge filter, no `.gitattributes` or
`.git/info/attributes` conversion, no `refs/replace` object, no sparse checkout and no ignored
or untracked file can change what runs (a clone sees the same bytes). Submodules (gitlinks) are
not followed; they are counted in `Room.skipped`.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cardgate.gitutil import GitError

GIT = ("git", "--no-replace-objects", "-c", "core.attributesFile=/dev/null")
ROOM_PREFIX = "cardgate-room-"
ROOM_SOURCE_ENV = "CARDGATE_ROOM_SOURCE"  # set by the gate for its child: the working tree


@dataclass(frozen=True)
class Room:
    path: Path
    commit: str
    files: int
    skipped: int = 0

    def to_dict(self) -> dict[str, object]:
        return {"commit": self.commit, "files": self.files, "submodules_skipped": self.skipped}


def _entries(root: Path, commit: str) -> list[tuple[str, str, str]]:
    proc = subprocess.run(
        [*GIT, "ls-tree", "-r", "-z", "--full-tree", commit],
        cwd=root,
        capture_output=True,
        check=False,
    )
    if proc.returncode != 0:
        raise GitError(f"git ls-tree {commit}: {proc.stderr.decode(errors='replace').strip()}")
    out = []
    for raw in proc.stdout.split(b"\0"):
        meta, _, path = raw.partition(b"\t")
        parts = meta.split()
        if len(parts) == 3 and path:
            out.append(
                (parts[0].decode(), parts[2].decode(), path.decode("utf-8", "surrogateescape"))
            )
    return out


def _blobs(root: Path, shas: list[str]) -> dict[str, bytes]:
    """Raw blob contents (no filter of any kind), by sha."""
    proc = subprocess.run(
        [*GIT, "cat-file", "--batch"],
        cwd=root,
        input="".join(f"{sha}\n" for sha in shas).encode(),
        capture_output=True,
        check=False,
    )
    if proc.returncode != 0:
        raise GitError(f"git cat-file: {proc.stderr.decode(errors='replace').strip()}")
    data, pos, out = proc.stdout, 0, {}
    while pos < len(data):
        end = data.index(b"\n", pos)
        sha, kind, size = data[pos:end].decode().split()
        start = end + 1
        if kind != "blob":
            raise GitError(f"object {sha} is a {kind}, not a blob")
        out[sha] = data[start : start + int(size)]
        pos = start + int(size) + 1
    return out


def build_room(root: Path, commit: str, dest: Path) -> Room:
    """Write the tree of `commit` under `dest` (an empty folder)."""
    entries = _entries(root, commit)
    files = [(m, s, p) for m, s, p in entries if m != "160000"]
    blobs = _blobs(root, sorted({s for _, s, _ in files}))
    for mode, sha, rel in files:
        if rel.startswith("/") or ".." in rel.split("/"):
            raise GitError(f"tree entry {rel!r} leaves the room")
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if mode == "120000":
            os.symlink(os.fsdecode(blobs[sha]), target)
            continue
        target.write_bytes(blobs[sha])
        if mode == "100755":
            target.chmod(0o755)
    return Room(dest, commit, len(files), len(entries) - len(files))
