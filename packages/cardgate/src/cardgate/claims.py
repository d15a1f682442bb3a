"""Items that state a number a benchmark must meet, and the gates rules that compare them.

An item states a number when it sits under `## Acceptance Criteria` and says how much (`at
least 10x`, `>= 1.8x`, `<= 3%`, `within 1.5 ms`, `at most 100 us`), or anywhere on the card
says how many times (`5x the Python reference`). Such an item must be named by a gates rule's
`items:` (its key or text): otherwise nothing compares the number and a bench that records 500
against 1000 would pass. Backlog cards are ideas, not work, and are not checked.
"""

from __future__ import annotations

import re

from cardgate.card import Card, Item, item_key
from cardgate.thresholds import GateSet

_RATIO = r"[0-9](?:\.[0-9]+)?[x\u00d7](?![A-Za-z0-9])"
_AMOUNT = (
    r"(?:>=|<=|=>|=<|\u2265|\u2264|<|>)\s*[+-]?[0-9]|[0-9]\s*%"
    r"|\b(?:at least|at most|within|no more than|no less than|under|below|above|over)"
    r"\s+[+-]?[0-9]"
)
_RATIO_RE = re.compile(_RATIO)
_AMOUNT_RE = re.compile(f"{_RATIO}|{_AMOUNT}", re.IGNORECASE)
EXEMPT_LANES = frozenset({"backlog"})


def states_a_number(item: Item) -> bool:
    if item.manual:
        return False
    if item.section == "acceptance criteria":
        return _AMOUNT_RE.search(item.text) is not None
    return _RATIO_RE.search(item.text) is not None


def unchecked_claims(card: Card, gates: GateSet) -> list[tuple[int, str]]:
    """(line, message) per item stating a number no rule names, and per rule naming an item
    the card does not have."""
    if card.lane in EXEMPT_LANES:
        return []
    named: dict[str, str] = {}
    out: list[tuple[int, str]] = []
    for gate in gates:
        for ref in gate.items:
            item = card.lookup(ref)
            if item is None:
                line = card.field_lines.get("gates", 1)
                out.append((line, f"gates rule {gate.source} names unknown item {ref!r}"))
            else:
                named.setdefault(item.key, gate.source)
    for item in card.items.values():
        if states_a_number(item) and item.key not in named:
            out.append(
                (
                    item.line,
                    f"item {item.text!r} states a number but no gates rule compares it: add "
                    f"`items: [{item_key(item.text)}]` to the rule that checks it "
                    f"(worklog/gates/{card.id}.yaml)",
                )
            )
    return out
