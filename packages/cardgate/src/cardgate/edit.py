"""Text edits the gate makes to a card on `pass`: tick boxes, set Status, append Validation."""

from __future__ import annotations

import re
from collections.abc import Iterable

_UNTICKED_RE = re.compile(r"^(?P<head>[ \t]*[-*+][ \t]+\[) (?P<tail>\].*)$")
_STATUS_RE = re.compile(r"^(?P<head>[ \t]*status[ \t]*:[ \t]*)(?P<value>.*)$", re.IGNORECASE)


def _split(text: str) -> tuple[list[str], bool]:
    return text.split("\n"), text.endswith("\n")


def tick(text: str, lines: Iterable[int]) -> str:
    """Tick the `- [ ]` boxes on the given 1-based lines (other lines are left alone)."""
    out, _ = _split(text)
    for lineno in lines:
        if 1 <= lineno <= len(out):
            out[lineno - 1] = _UNTICKED_RE.sub(r"\g<head>x\g<tail>", out[lineno - 1])
    return "\n".join(out)


def set_status(text: str, lineno: int | None, status: str) -> str:
    """Rewrite the `Status:` field on `lineno` (or insert one after the title line)."""
    out, _ = _split(text)
    if lineno is not None and 1 <= lineno <= len(out) and _STATUS_RE.match(out[lineno - 1]):
        out[lineno - 1] = _STATUS_RE.sub(rf"\g<head>{status}", out[lineno - 1])
        return "\n".join(out)
    title = next((i for i, line in enumerate(out) if line.strip()), 0)
    out.insert(title + 1, f"Status: {status}")
    return "\n".join(out)


def append_validation(text: str, date: str, lines: Iterable[str]) -> str:
    """Append a `## Validation (date)` section with one bullet per line."""
    body = text.rstrip("\n")
    bullets = "\n".join(f"- {line}" for line in lines)
    return f"{body}\n\n## Validation ({date})\n{bullets}\n"


_VALIDATION_RE = re.compile(r"^## Validation \(", re.MULTILINE)


def replace_validation(text: str, date: str, lines: Iterable[str]) -> str:
    """`append_validation`, replacing a trailing gate-written `## Validation` section (re-gate)."""
    matches = list(_VALIDATION_RE.finditer(text))
    if matches:
        tail = text[matches[-1].start() :]
        rest = tail.split("\n", 1)[1] if "\n" in tail else ""
        if "\n## " not in "\n" + rest and "Gate: pass" in rest:
            text = text[: matches[-1].start()]
    return append_validation(text, date, lines)
