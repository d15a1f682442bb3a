"""Items that state a number a benchmark must meet, and the gates rules that compare them.

An item states a number when it sits under `## Acceptance Criteria` and says how much (`at
least 10x`, `>= 1.8x`, `<= 3%`, `within 1.5 ms`, `at most 100 us`), or anywhere on the card
says how many times (`5x the Python reference`). Such an item must be named by a gates rule's
`items:` (its key or text): otherwise nothing compares the number and a bench that records 500
against 1000 would pass. Backlog cards are ideas, not work, and are not checked. At the gate,
a metric recorded by a test bound to such an item that no applicable rule compares holds the
card (`uncompared_metric_checks`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from cardgate.card import Card, Item, item_key
from cardgate.outcome import Check, Verdict
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


def uncompared_metric_checks(
    card: Card,
    gates: GateSet,
    metrics: list[tuple[str, str]],
    bound: Mapping[str, tuple[str, ...]],
    hardware: str,
) -> list[Check]:
    """A HOLD per metric (name, nodeid) recorded by a test bound to an item that states a
    number when no rule for `hardware` compares it (nor `record_only` lists it): the number
    the item states was never compared."""
    claiming = {
        nodeid
        for key, nodes in bound.items()
        if (item := card.items.get(key)) is not None and states_a_number(item)
        for nodeid in nodes
    }
    names = {name for name, nodeid in metrics if nodeid in claiming}
    return [
        Check(
            f"metric {name}",
            Verdict.HOLD,
            f"recorded for an item that states a number, but no gates rule for {hardware!r} "
            "compares it: add a rule (or list it under record_only)",
        )
        for name in gates.unchecked(names, hardware)
    ]
