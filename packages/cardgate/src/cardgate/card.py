"""Parse one kanban card (a markdown file) into a `Card` with keyed checklist items.

The parser never raises on bad input: `parse_card` returns a `ParseResult` holding the card (or
None when no `# ID: Title` header exists) and a list of `CardError` with file and line number.

Card format::

    # P0-003: Radix cache core in Rust
    Priority: P0
    Status: in-progress
    Depends on: P0-002, P0-001
    Tests: packages/x/tests            (optional: extra pytest paths the gate collects)
    Gates: worklog/gates/P0-003.yaml   (optional: default worklog/gates/<ID>.yaml)
    Timeout: 120                       (optional: seconds per test, default none)

    ## Checklist
    - [ ] Parent item:
      - [ ] child item (nested by indentation)
    - [x] Something a person checks (manual)

    ## TDD Subtasks
    1. Red
    - [ ] Failing tests first.

Items live in the sections `Checklist`, `TDD Subtasks` and `Acceptance Criteria`; other
sections are kept (`Card.sections`) and never parsed for items, and a checkbox line there (or in
the header) is a lint error, as are near-miss item section names (`## Check list`), unknown
header fields and TDD phase headings that name no phase. Each item's key is the slug of
its text without the `(manual)` marker, unique within the card.
"""

from __future__ import annotations

import difflib
import math
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ITEM_SECTIONS = frozenset({"checklist", "tdd subtasks", "acceptance criteria"})
ITEM_SECTION_TITLES = ("Checklist", "TDD Subtasks", "Acceptance Criteria")
PHASES = frozenset({"red", "green", "refactor"})
FIELDS = ("priority", "status", "depends on", "tests", "gates", "timeout")
STATUSES = ("todo", "in-progress", "done", "backlog")
CARD_ID_RE = re.compile(r"^[A-Z][A-Z0-9]*-[0-9]+$", re.ASCII)  # ASCII digits only
PHASE_GRAMMAR = "'1. Red', '2. Green', '3. Refactor' (a numbered line) or '### Red'"

_TITLE_RE = re.compile(r"^#[ \t]+(?P<id>[^\s:]+)[ \t]*:[ \t]*(?P<title>.*)$")
_FIELD_RE = re.compile(r"^(?P<key>[A-Za-z][A-Za-z0-9 _-]*?)[ \t]*:[ \t]*(?P<value>.*)$")
_SECTION_RE = re.compile(r"^##[ \t]+(?P<name>.*?)[ \t#]*$")
_SUBHEADING_RE = re.compile(r"^###+[ \t]+(?P<name>.*?)[ \t#]*$")
_CHECKBOX_RE = re.compile(r"^(?P<indent>[ \t]*)[-*+][ \t]+\[(?P<mark>[ xX])\][ \t]+(?P<text>\S.*)$")
_BAD_CHECKBOX_RE = re.compile(r"^[ \t]*(?:[-*+]|\d+[.)])[ \t]*\[")
_BULLET_RE = re.compile(r"^[ \t]*[-*+][ \t]+\S")
_PHASE_RE = re.compile(r"^[ \t]*\d+[.)][ \t]+(?P<label>\S.*)$")
_MANUAL_RE = re.compile(r"\s*\(manual\)\s*$", re.IGNORECASE)  # a trailing marker only
_FENCE_RE = re.compile(r"^[ \t]*(```|~~~)")
_QUOTED_CHECKBOX_RE = re.compile(r"^[ \t]*>.*?(?:[-*+]|\d+[.)])?[ \t]*\[[ xX]?\]")
_TIMEOUT_RE = re.compile(r"^(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)$")
_PHASE_LABEL_RE = re.compile(r"^(?P<word>red|green|refactor)\s*(?:\(.*\))?\s*:?$", re.IGNORECASE)
_HTML_TAG_RE = re.compile(r"</?[A-Za-z][^>]*>")
_DATE_SUFFIX_RE = re.compile(r"\s*\(.*\)\s*$")
_ANY_LIST_RE = re.compile(r"^[ \t]*(?:[-*+]|\d+[.)])(?:[ \t]|$)")
_ANY_CHECKBOX_RE = re.compile(r"^[ \t]*(?:[-*+]|\d+[.)])[ \t]*\[[ xX]?\]")
_PHASE_PREFIX_RE = re.compile(
    r"^(?:(?:phase|step)\s*)?\d*\s*[:.)\-\u2013\u2014]*\s*", re.IGNORECASE
)
# a line of the TDD section that reads as a heading: `Red:`, `**Red**`, `1 - Red`, `Step 1: Red`
_HEADING_LIKE_RE = re.compile(
    r"^(?P<prefix>(?:phase|step|stage)\b[^:]*:?|\d+\s*[-:.)\u2013\u2014]+)?\s*"
    r"(?P<word>[A-Za-z]+)(?P<rest>.*)$",
    re.IGNORECASE,
)

_ErrorFn = Callable[[int, str], None]


@dataclass(frozen=True, order=True)
class CardError:
    """A problem in a card file, always with its file and 1-based line (0: the whole file)."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclass
class Item:
    """One checkbox line of a card."""

    key: str
    text: str
    checked: bool
    manual: bool
    line: int
    indent: int
    section: str
    phase: str | None = None
    parent: str | None = None
    children: list[str] = field(default_factory=list)


@dataclass
class Card:
    """A parsed card. `fields` holds every header field with lower-cased names."""

    id: str
    title: str
    path: str
    text: str
    fields: dict[str, str] = field(default_factory=dict)
    field_lines: dict[str, int] = field(default_factory=dict)
    depends_on: list[str] = field(default_factory=list)
    items: dict[str, Item] = field(default_factory=dict)
    sections: list[str] = field(default_factory=list)
    lane: str | None = None

    @property
    def priority(self) -> str | None:
        return self.fields.get("priority")

    @property
    def status(self) -> str | None:
        raw = self.fields.get("status")
        return normalize_status(raw) if raw is not None else None

    @property
    def timeout(self) -> float | None:
        return parse_timeout(self.fields.get("timeout"))

    @property
    def tests(self) -> list[str]:
        return split_list(self.fields.get("tests", ""))

    @property
    def gates(self) -> list[str]:
        return split_list(self.fields.get("gates", ""))

    def lookup(self, ref: str) -> Item | None:
        """The item named by `ref`: its key, or its exact text (with or without `(manual)`)."""
        return self.items.get(item_key(ref))

    def leaves(self) -> list[Item]:
        return [item for item in self.items.values() if not item.children]

    def descendants(self, key: str) -> list[str]:
        out: list[str] = []
        for child in self.items[key].children:
            out.append(child)
            out.extend(self.descendants(child))
        return out

    def red_items(self) -> list[Item]:
        return [item for item in self.items.values() if item.phase == "red"]


@dataclass
class ParseResult:
    card: Card | None
    errors: list[CardError]


def slugify(text: str) -> str:
    """`Page-aligned match & insert` -> `page-aligned-match-insert` (ASCII, lower, dashes)."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")


def item_key(text: str) -> str:
    """The stable key of an item text: the slug of the text without its `(manual)` marker."""
    return slugify(_MANUAL_RE.sub(" ", text))


def normalize_status(raw: str) -> str:
    return re.sub(r"[\s_]+", "-", raw.strip().lower())


def split_list(raw: str) -> list[str]:
    parts = [part.strip() for part in re.split(r"[,\s]+", raw)]
    return [p for p in parts if p and p.lower() not in {"none", "-", "n/a"}]


def _indent_width(prefix: str) -> int:
    return len(prefix.expandtabs(4))


def _section_name(raw: str) -> str:
    return _DATE_SUFFIX_RE.sub("", raw).strip().lower()


def _letters(text: str) -> str:
    return re.sub(r"[^a-z]", "", text.lower())


def near_item_section(name: str) -> str | None:
    """The item section title `name` was probably meant to be (`Check list` -> `Checklist`)."""
    letters = _letters(name)
    for title in ITEM_SECTION_TITLES:
        target = _letters(title)
        if letters == target or difflib.SequenceMatcher(None, letters, target).ratio() >= 0.8:
            return title
    if letters in {"acceptance", "criteria", "tdd", "subtasks", "todo", "tasks", "checks"}:
        return "Checklist" if letters in {"todo", "tasks", "checks"} else None
    return None


def parse_timeout(raw: str | None) -> float | None:
    """`Timeout:` seconds: an ASCII decimal, finite and positive (`inf`, `nan`, `-1`, `1e309`
    and Unicode digits are None, which the parser reports)."""
    if not raw or not _TIMEOUT_RE.match(raw.strip()):
        return None
    value = float(raw)
    return value if math.isfinite(value) and value > 0 else None


def phase_of(label: str) -> str | None:
    """The phase a numbered or `###` heading label names, from a closed grammar: an optional
    `Phase N:` / `Step N:` / `N.` prefix, emoji and emphasis aside, then exactly `Red`, `Green`
    or `Refactor` with an optional `(note)` and `:`. `1. **Red**`, `Phase 1: Red`,
    `🔴 Red (failing first)` -> "red"; `Red phase`, `Red tests` -> None."""
    plain = "".join(ch for ch in label if ch.isascii())
    plain = re.sub(r"[*_`~]", "", plain).strip()
    plain = _PHASE_PREFIX_RE.sub("", plain, count=1).strip()
    match = _PHASE_LABEL_RE.match(plain)
    return match.group("word").lower() if match else None


def phase_like(line: str) -> bool:
    """A TDD-section line that is not a list item but reads like a phase heading: it names a
    phase in its first word or in a short line (`Red phase`, `I. Red`, `<h3>Red</h3>`,
    `**Red**`). `No red records: ...` is prose."""
    plain = "".join(ch for ch in _HTML_TAG_RE.sub(" ", line) if ch.isascii())
    words = [w.lower() for w in re.findall(r"[A-Za-z]+", plain)]
    if not any(w in PHASES for w in words):
        return False
    return words[0] in PHASES or len(words) <= 4


def invisible_characters(line: str) -> list[tuple[int, str]]:
    """(column, `U+200B ZERO WIDTH SPACE`) for each format or control character in `line`:
    zero-width spaces and joiners, bidi controls, a BOM, soft hyphens (tabs are fine)."""
    return [
        (col, f"U+{ord(ch):04X} {unicodedata.name(ch, 'unnamed')}")
        for col, ch in enumerate(line, start=1)
        if ch != "\t" and unicodedata.category(ch) in {"Cf", "Cc", "Co", "Cs", "Zl", "Zp"}
    ]


def phase_heading(line: str) -> str | None:
    """A TDD-section line that reads as a phase heading: its phase ("red", ...), "" when it
    looks like a heading but names no phase (`Phase A`), None for prose. `🔴 Red`, `Red:`,
    `**Red**`, `1 - Red` and `Step 1: Red` are Red headings; `No red records yet.` is prose."""
    plain = re.sub(r"[*_`~#>]", "", "".join(ch for ch in line if ch.isascii())).strip()
    match = _HEADING_LIKE_RE.match(plain)
    if match is None:
        return "" if plain.endswith(":") and len(plain) <= 40 else None
    word, rest = match.group("word").lower(), match.group("rest").strip()
    if word in PHASES and (not rest or rest[0] in ":(-\u2013\u2014"):
        return word
    if match.group("prefix") or (plain.endswith(":") and len(plain) <= 40):
        return ""
    if re.match(r"(?i)^(phase|step|stage)\b", plain):
        return ""
    return None


def parse_card(text: str, path: str | Path = "<card>") -> ParseResult:
    """Parse card text. Never raises: problems come back as `CardError`s with line numbers."""
    where = str(path)
    errors: list[CardError] = []

    def error(line: int, message: str) -> None:
        errors.append(CardError(where, line, message))

    body = text[1:] if text.startswith("\ufeff") else text  # a leading BOM is an encoding mark
    lines = [line.rstrip("\r") for line in body.split("\n")]
    for lineno, line in enumerate(lines, start=1):
        for col, name in invisible_characters(line):
            error(
                lineno,
                f"invisible character {name} at column {col}: remove it (it can hide a "
                "checkbox or make two ids look alike)",
            )
    title_index = next((i for i, line in enumerate(lines) if line.strip()), None)
    if title_index is None:
        error(0, "empty card: expected a '# ID: Title' header")
        return ParseResult(None, errors)
    match = _TITLE_RE.match(lines[title_index].strip())
    if match is None:
        error(title_index + 1, "expected a '# ID: Title' header as the first line")
        return ParseResult(None, errors)
    card_id = match.group("id")
    if not CARD_ID_RE.match(card_id):
        error(title_index + 1, f"bad card id {card_id!r}: expected e.g. 'P0-003' or 'BK-001'")
    card = Card(id=card_id, title=match.group("title").strip(), path=where, text=text)

    section: str | None = None
    phase: str | None = None
    stack: list[tuple[int, str]] = []
    in_fence = False
    for index in range(title_index + 1, len(lines)):
        lineno = index + 1
        line = lines[index]
        if _FENCE_RE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if _QUOTED_CHECKBOX_RE.match(line):
            error(
                lineno,
                f"checkbox inside a '>' quote: {line.strip()!r} is never gated: "
                "write it as a '- [ ] text' item or drop the brackets",
            )
            continue
        if line.startswith("# "):
            error(lineno, "a card has exactly one '# ID: Title' header")
            continue
        section_match = _SECTION_RE.match(line)
        if section_match is not None and not line.startswith("###"):
            raw_name = section_match.group("name")
            section = _section_name(raw_name)
            card.sections.append(section)
            phase = None
            stack.clear()
            if section not in ITEM_SECTIONS and (near := near_item_section(section)):
                error(
                    lineno,
                    f"section '## {raw_name}' is not an item section: did you mean "
                    f"'## {near}'? (items are read only under "
                    f"{', '.join('## ' + t for t in ITEM_SECTION_TITLES)})",
                )
            continue
        sub = _SUBHEADING_RE.match(line)
        if section is None or section not in ITEM_SECTIONS:
            if sub is not None and (near := near_item_section(_section_name(sub.group("name")))):
                error(lineno, f"'{line.strip()}' is not a section: write '## {near}'")
            elif _ANY_CHECKBOX_RE.match(line):
                where_ = "the header" if section is None else f"section '{section}'"
                error(
                    lineno,
                    f"checkbox line in {where_}, outside an item section "
                    f"({', '.join(ITEM_SECTION_TITLES)}): it would never be gated",
                )
            elif section is None:
                _parse_field(card, line, lineno, error)
            continue
        phase_match = _PHASE_RE.match(line)
        if sub is not None or (phase_match is not None and section == "tdd subtasks"):
            label = sub.group("name") if sub is not None else phase_match.group("label")  # type: ignore[union-attr]
            phase = phase_of(label)
            stack.clear()
            if phase_match is not None and _BAD_CHECKBOX_RE.match(line):
                error(lineno, f"unparseable checkbox line: {line.strip()!r}")
            elif phase is None and section == "tdd subtasks":
                error(
                    lineno,
                    f"unrecognised TDD phase heading {line.strip()!r}: "
                    f"the phase headings are {PHASE_GRAMMAR}",
                )
            continue
        tdd_prose = section == "tdd subtasks" and line.strip() and not _ANY_LIST_RE.match(line)
        if tdd_prose and (phase_like(line) or phase_heading(line) is not None):
            phase = None
            stack.clear()
            error(
                lineno,
                f"phase-like line {line.strip()!r} is not a phase heading: "
                f"the phase headings are {PHASE_GRAMMAR}",
            )
            continue
        _parse_item_line(card, line, lineno, section, phase, stack, error)
    if in_fence:
        error(len(lines), "unclosed ``` code fence")
    return ParseResult(card, errors)


def _parse_field(card: Card, line: str, lineno: int, error: _ErrorFn) -> None:
    if not line.strip():
        return
    match = _FIELD_RE.match(line.strip())
    if match is None:
        return
    key = re.sub(r"[\s_-]+", " ", match.group("key").strip().lower())
    value = match.group("value").strip()
    if key in card.fields:
        error(lineno, f"duplicate header field {key!r} (first at line {card.field_lines[key]})")
        return
    card.fields[key] = value
    card.field_lines[key] = lineno
    if key not in FIELDS:
        close = difflib.get_close_matches(key, FIELDS, n=1, cutoff=0.5)
        hint = f": did you mean '{close[0].capitalize()}:'?" if close else ""
        known = ", ".join(f.capitalize() for f in FIELDS)
        error(lineno, f"unknown header field {match.group('key')!r}{hint} (known: {known})")
    if key == "timeout" and card.timeout is None:
        error(lineno, f"Timeout {value!r}: expected a finite positive number of seconds (ASCII)")
    if key == "status" and normalize_status(value) not in STATUSES:
        error(lineno, f"unknown Status {value!r}: expected one of {', '.join(STATUSES)}")
    if key == "depends on":
        for dep in split_list(value):
            if CARD_ID_RE.match(dep):
                card.depends_on.append(dep)
            else:
                error(lineno, f"bad card id {dep!r} in 'Depends on'")


def _parse_item_line(
    card: Card,
    line: str,
    lineno: int,
    section: str,
    phase: str | None,
    stack: list[tuple[int, str]],
    error: _ErrorFn,
) -> None:
    match = _CHECKBOX_RE.match(line)
    if match is None:
        if _BAD_CHECKBOX_RE.match(line):
            error(lineno, f"unparseable checkbox line: {line.strip()!r} (expected '- [ ] text')")
        elif _BULLET_RE.match(line):
            error(lineno, f"list item without a checkbox: {line.strip()!r} (use '- [ ] text')")
        return
    text = match.group("text").strip()
    key = item_key(text)
    if not key:
        error(lineno, f"item {text!r} has no letters or digits to form a key")
        return
    if key in card.items:
        first = card.items[key].line
        error(lineno, f"duplicate item key {key!r} (first at line {first})")
        return
    indent = _indent_width(match.group("indent"))
    while stack and stack[-1][0] >= indent:
        stack.pop()
    parent = stack[-1][1] if stack else None
    item = Item(
        key=key,
        text=text,
        checked=match.group("mark") != " ",
        manual=_MANUAL_RE.search(text) is not None,
        line=lineno,
        indent=indent,
        section=section,
        phase=phase,
        parent=parent,
    )
    if parent is not None:
        parent_item = card.items[parent]
        parent_item.children.append(key)
        if item.phase is None:
            item.phase = parent_item.phase
    card.items[key] = item
    stack.append((indent, key))
    if item.phase == "red" and item.manual and item.checked:
        error(
            lineno,
            f"ticked (manual) item {text!r} under Red: a red phase is proven by a red gate "
            "record, never by a tick",
        )
