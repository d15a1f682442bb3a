"""The few git facts the gate needs: HEAD, dirtiness (ignoring evidence), ancestry, `git mv`."""

from __future__ import annotations

import subprocess
from pathlib import Path

EVIDENCE_DIR = "worklog/evidence"


class GitError(RuntimeError):
    pass


def git(
    root: Path, *args: str, check: bool = True, input_text: str | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, input=input_text
    )
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
    """True when `commit` resolves to a real ancestor of `of` and is not `of` itself."""
    full, head_ = resolve(root, commit), resolve(root, of)
    if full is None or head_ is None or full == head_:
        return False
    proc = git(root, "merge-base", "--is-ancestor", full, head_, check=False)
    return proc.returncode == 0


def is_ancestor(root: Path, commit: str, of: str) -> bool:
    """True when `commit` is `of` or one of its ancestors."""
    full, head_ = resolve(root, commit), resolve(root, of)
    if full is None or head_ is None:
        return False
    return git(root, "merge-base", "--is-ancestor", full, head_, check=False).returncode == 0


def resolve(root: Path, rev: str) -> str | None:
    """The full sha of a commit `rev` names (None when it names no commit of this repo)."""
    if not rev or rev.startswith("-"):
        return None
    proc = git(root, "rev-parse", "--verify", "-q", f"{rev}^{{commit}}", check=False)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def changed_files(root: Path, old: str, new: str) -> list[str]:
    proc = git(root, "diff", "--name-only", old, new, "--", check=False)
    return [line for line in proc.stdout.splitlines() if line.strip()]


def git_dir(root: Path) -> Path | None:
    proc = git(root, "rev-parse", "--absolute-git-dir", check=False)
    return Path(proc.stdout.strip()) if proc.returncode == 0 and proc.stdout.strip() else None
