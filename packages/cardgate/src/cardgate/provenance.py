"""Does the recorded commit hold the code that ran? Checks over a run's inventory.

- plugins and conftest files that could rewrite a result and were not declared, and cardgate
  fixtures (`metric`, ...) redefined elsewhere: fail;
- a `sitecustomize` / `usercustomize` from outside the interpreter: fail (it runs first and can
  change any result, in a red run as in a green one);
- every repository module the run imported and every bound test file is tracked at the
  commit, unmodified (compared by content, which `git status` skips for files marked
  skip-worktree or assume-unchanged) and inside the root (no symlink out): else hold;
- every file a static scan finds bound to the card was collected: else fail;
- in a clean room (`cardgate.room`): a module imported from the working tree instead of the
  room (an editable install the room could not redirect) holds, and the files that ran are
  compared with the commit as the room held them after the run (a test that rewrote one holds);
- a `.pth` file that runs code at start-up and belongs to no installed distribution: fail.
"""

from __future__ import annotations

from pathlib import Path

from cardgate import gitutil
from cardgate.outcome import Check, Verdict
from cardgate.run import Inventory, RunResult

MAX_SHOWN = 8


def inventory_checks(inv: Inventory) -> list[Check]:
    checks = []
    for plugin in inv.plugins:
        if plugin.get("allowed", True):
            continue
        hooks = ", ".join(plugin.get("hooks") or []) or "no report hooks"
        checks.append(
            Check(
                "plugins",
                Verdict.FAIL,
                f"undeclared plugin {plugin['name']} ({plugin.get('origin')}, "
                f"{plugin.get('file') or '?'}; {hooks}): it could rewrite results; declare it in "
                "the ini option cardgate_plugins or remove it",
            )
        )
    for override in inv.fixture_overrides:
        checks.append(
            Check(
                "fixtures",
                Verdict.FAIL,
                f"the {override['fixture']} fixture is redefined in {override['where']}: "
                "evidence fixtures come from cardgate only",
            )
        )
    for startup in inv.environment.get("foreign_startup") or []:
        checks.append(
            Check(
                "environment",
                Verdict.FAIL,
                f"a sitecustomize/usercustomize from outside the interpreter ran first "
                f"({startup}): it can change any result; unset the PYTHONPATH that loads it",
            )
        )
    for pth in inv.environment.get("pth") or []:
        if pth.get("code") and not pth.get("dist"):
            checks.append(
                Check(
                    "environment",
                    Verdict.FAIL,
                    f"{pth.get('dir')}/{pth['file']} runs code at every interpreter start and "
                    "belongs to no installed distribution: it can patch any code before a test "
                    "runs; remove it",
                )
            )
    for path in inv.worktree_modules[:MAX_SHOWN]:
        checks.append(
            Check(
                "provenance",
                Verdict.HOLD,
                f"{path} was imported from the working tree, not from the clean room of the "
                "commit (an editable install the room could not redirect)",
            )
        )
    for path in inv.shadowed_modules[:MAX_SHOWN]:
        checks.append(
            Check(
                "provenance",
                Verdict.HOLD,
                f"{path}: the commit's module ran from outside the room, not from the clean "
                "room of the commit (an editable install of another checkout?): install this "
                "repository's packages into the gate's interpreter",
            )
        )
    return checks


def _tree(root: Path, commit: str) -> dict[str, tuple[str, str]]:
    """path -> (mode, blob sha) of every file at `commit`."""
    proc = gitutil.git(root, "ls-tree", "-r", "-z", "--full-tree", commit, check=False)
    out: dict[str, tuple[str, str]] = {}
    for entry in proc.stdout.split("\0"):
        meta, _, path = entry.partition("\t")
        parts = meta.split()
        if len(parts) == 3 and path:
            out[path] = (parts[0], parts[2])
    return out


def _hashes(root: Path, paths: list[str], where: Path | None = None) -> dict[str, str]:
    """Blob shas of files under `where` (default: `root`), without filters."""
    if not paths:
        return {}
    base = where or root
    proc = gitutil.git(
        root,
        "hash-object",
        "--no-filters",
        "--stdin-paths",
        check=False,
        input_text="\n".join(str(base / p) for p in paths) + "\n",
    )
    return dict(zip(paths, proc.stdout.split(), strict=False))


def ran_paths(run: RunResult) -> list[str]:
    bound_files = {n.split("::", 1)[0] for nodes in run.bound.values() for n in nodes}
    return sorted(set(run.inventory.modules) | bound_files)


def provenance_checks(
    root: Path, commit: str | None, run: RunResult, where: Path | None = None
) -> list[Check]:
    """`where`: the folder the run read its files from (the clean room, still there), else
    the working tree."""
    if commit is None or not gitutil.is_repo(root):
        return []
    paths = ran_paths(run)
    tree = _tree(root, commit)
    base = where or root
    real_root = base.resolve()
    problems: list[str] = []
    regular: list[str] = []
    for path in paths:
        full = base / path
        if path in run.inventory.outside_modules or not full.resolve().is_relative_to(real_root):
            problems.append(f"{path} resolves outside the repository: git does not hold it")
        elif path not in tree:
            problems.append(f"{path} ran but is not tracked at the commit (ignored or excluded?)")
        elif full.is_file() and not full.is_symlink():
            regular.append(path)
    for path, sha in _hashes(root, regular, base).items():
        if tree[path][1] != sha:
            problems.append(
                f"{path} differs from the commit (uncommitted, or hidden from git status by "
                "skip-worktree / assume-unchanged)"
            )
    checks = [Check("provenance", Verdict.HOLD, p) for p in problems[:MAX_SHOWN]]
    if len(problems) > MAX_SHOWN:
        checks.append(
            Check("provenance", Verdict.HOLD, f"... and {len(problems) - MAX_SHOWN} more files")
        )
    if not problems and paths:
        checks.append(
            Check("provenance", Verdict.PASS, f"{len(paths)} files that ran match the commit")
        )
    return checks


def collection_checks(run: RunResult) -> list[Check]:
    collected = {n.split("::", 1)[0] for nodes in run.bound.values() for n in nodes}
    return [
        Check(
            "collection",
            Verdict.FAIL,
            f"{path} binds tests to the card (static scan) but none was collected "
            "(an --ignore, collect_ignore or a name pytest does not collect?)",
        )
        for path in run.static_files
        if path not in collected
    ]
