"""Paths in evidence, baselines and docs without the machine that wrote them.

`redact(text, root)` replaces the repository root with `.`, the interpreter's virtualenv with
`<venv>`, the home directory with `~` and the temporary directory with `<tmp>`; any other
absolute path under a private prefix (`PRIVATE_PATH_RE`: home, tmp and workspace folders) loses
its first folder to a placeholder. The privacy lint uses the same pattern, so whatever the gate
writes passes it.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import socket
import sys
import tempfile
from pathlib import Path

NAMES_ENV = "CARDGATE_PRIVATE_NAMES"
GENERIC_NAMES = frozenset(
    {"root", "user", "users", "admin", "runner", "ubuntu", "debian", "localhost", "vm"}
    | {"host", "node", "docker", "build", "builder", "ci", "gate", "test", "runneradmin"}
)

_NOT_AFTER = r"(?<![\w.~<>/\\-])"  # not inside a URL, a relative path or a placeholder
PRIVATE_PATH_RE = re.compile(
    _NOT_AFTER
    + r"(?:/(?P<top>home|Users|root|tmp|var/tmp|var/folders|private|work|workspace|mnt|data|scratch)"
    r"(?![\w.-])(?P<rest>/[^\s\"'`<>|,;:)\]}]+)"
    r"|[A-Za-z]:\\Users\\[^\s\"'`<>|,;:]*)"
)
_HOME_TOPS = frozenset({"home", "Users"})
_TMP_TOPS = frozenset({"tmp", "var/tmp", "var/folders", "private"})


def _placeholder(match: re.Match[str]) -> str:
    top, rest = match.group("top"), match.group("rest") or ""
    if top is None:  # a Windows user folder
        return "~"
    if top in _HOME_TOPS:  # /home/<user>/x -> ~/x
        return "~" + rest[rest.find("/", 1) :] if rest.count("/") > 1 else "~"
    if top == "root":
        return "~" + rest
    if top in _TMP_TOPS:
        return "<tmp>" + rest
    return "<local>" + rest[rest.find("/", 1) :] if rest.count("/") > 1 else "<local>"


def _known(root: Path | None) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    if root is not None:
        pairs += [(str(root), "."), (os.path.realpath(root), ".")]
    if sys.prefix != sys.base_prefix:
        pairs += [(sys.prefix, "<venv>"), (os.path.realpath(sys.prefix), "<venv>")]
    home = os.path.expanduser("~")
    if home not in {"/", ""}:
        pairs += [(home, "~"), (os.path.realpath(home), "~")]
    tmp = tempfile.gettempdir()
    pairs += [(tmp, "<tmp>"), (os.path.realpath(tmp), "<tmp>")]
    # longest first (a root under the temporary directory stays `.`); on a tie, the first named
    rank = {old: i for i, (old, _) in reversed(list(enumerate(pairs)))}
    unique = {old: new for old, new in reversed(pairs) if len(old) > 1}
    return sorted(unique.items(), key=lambda p: (-len(p[0]), rank[p[0]]))


def private_names() -> list[str]:
    """Names a record must not hold: `CARDGATE_PRIVATE_NAMES` (comma-separated) and this
    machine's user and host name when specific enough (not `root`, `runner`, ...)."""
    names = set(os.environ.get(NAMES_ENV, "").split(","))
    with contextlib.suppress(KeyError, OSError):
        names.add(getpass.getuser())
    host = socket.gethostname()
    names.update({host, host.split(".")[0]})
    return sorted(
        n.strip()
        for n in names
        if len(n.strip()) >= 3 and n.strip().lower() not in GENERIC_NAMES and "," not in n
    )


def scrub_names(text: str, names: list[str] | None = None) -> str:
    """`text` with every private name (whole word) replaced by `<private>`."""
    names = private_names() if names is None else names
    if not names:
        return text
    pattern = r"(?<![\w.-])(?:" + "|".join(map(re.escape, names)) + r")(?![\w-])"
    return re.sub(pattern, "<private>", text)


def redact(text: str, root: Path | None = None) -> str:
    """`text` with every local absolute path made repo-relative or replaced by a placeholder."""
    for old, new in _known(root):
        text = re.sub(_NOT_AFTER + re.escape(old) + r"(?=$|[/\\\s\"'`:;,)\]}])", new, text)
    return PRIVATE_PATH_RE.sub(_placeholder, text)
