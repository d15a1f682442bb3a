"""The few git facts the gate needs: HEAD, dirtiness (ignoring evidence), ancestry, `git mv`."""

from __future__ import annotations

import subprocess
from pathlib import Path

EVIDENCE_DIR = "worklog/evidence"


class GitError(RuntimeError):
    pass


def git(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise GitError(f"git {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def is_repo(root: Path) -> bool:
    proc = git(root, "rev-parse", "--is-inside-work-tree", check=False)
    return proc.returncode == 0 and proc.stdout.strip() == "true"


def head(root: Path) -> str | None:
    proc = git(root, "rev-parse", "--verify", "-q", "HEAD", check=False)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def dirty_files(root: Path) -> list[str]:
    """Changed, staged or untracked (not ignored) paths, except the gate's own evidence."""
    proc = git(
        root,
        "status",
        "--porcelain=v1",
        "--untracked-files=all",
        "--",
        ".",
        f":(exclude){EVIDENCE_DIR}",
    )
    return [line[3:] for line in proc.stdout.splitlines() if line.strip()]


def is_strict_ancestor(root: Path, commit: str, of: str) -> bool:
    """True when `commit` is an ancestor of `of` and not `of` itself."""
    if not commit or commit == of:
        return False
    proc = git(root, "merge-base", "--is-ancestor", commit, of, check=False)
    return proc.returncode == 0
