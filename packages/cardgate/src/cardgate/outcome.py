"""Typed results shared by the gate's stages: verdicts, decisions, item verdicts, checks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from cardgate.thresholds import GateResult


class Verdict(enum.StrEnum):
    """How one item or check stands; the worst one decides the gate."""

    PASS = "pass"
    HOLD = "hold"
    FAIL = "fail"

    @property
    def rank(self) -> int:
        return _RANK[self]

    @property
    def label(self) -> str:
        return self.value.upper()


_RANK = {Verdict.PASS: 0, Verdict.HOLD: 1, Verdict.FAIL: 2}


def worst(verdicts: list[Verdict] | tuple[Verdict, ...]) -> Verdict:
    return max(verdicts, key=lambda v: v.rank, default=Verdict.PASS)


class Decision(enum.StrEnum):
    """The gate's answer and its exit code: 0 pass, 1 fail, 2 hold, 3 usage or lint error."""

    PASS = "pass"
    FAIL = "fail"
    HOLD = "hold"
    USAGE = "usage"

    @property
    def exit_code(self) -> int:
        return _EXIT[self]

    @classmethod
    def of(cls, verdict: Verdict) -> Decision:
        return cls(verdict.value)


_EXIT = {Decision.PASS: 0, Decision.FAIL: 1, Decision.HOLD: 2, Decision.USAGE: 3}


class Phase(enum.StrEnum):
    RED = "red"
    GREEN = "green"


class GateUsageError(Exception):
    """Unknown card, lint errors, a lock held, a bad gates file: the gate cannot decide (3)."""


@dataclass(frozen=True)
class ItemVerdict:
    key: str
    text: str
    status: Verdict
    reason: str
    depth: int = 0
    phase: str | None = None
    manual: bool = False
    tests: tuple[str, ...] = ()
    hint: str = ""


@dataclass(frozen=True)
class Check:
    name: str
    status: Verdict
    reason: str


@dataclass(frozen=True)
class RedFailure:
    """A Red item's bound test that failed by assertion in a red run."""

    key: str
    nodeids: tuple[str, ...]


@dataclass(frozen=True)
class GateOutcome:
    card_id: str
    phase: Phase
    verdict: Verdict
    items: tuple[ItemVerdict, ...]
    checks: tuple[Check, ...]
    thresholds: tuple[GateResult, ...]
    commit: str | None
    dirty: tuple[str, ...]
    red_failures: tuple[RedFailure, ...] = ()

    @property
    def decision(self) -> Decision:
        return Decision.of(self.verdict)


@dataclass(frozen=True)
class Recorded:
    """What the record stage wrote: the evidence folder, the card move, the commit."""

    evidence_dir: str | None = None
    moved_to: str | None = None
    card_paths: tuple[str, ...] = ()
    card_sha256: str | None = None
    committed: str | None = None


@dataclass(frozen=True)
class GateReport:
    outcome: GateOutcome
    recorded: Recorded = field(default_factory=Recorded)

    @property
    def decision(self) -> Decision:
        return self.outcome.decision

    @property
    def exit_code(self) -> int:
        return self.decision.exit_code

    def to_dict(self) -> dict[str, Any]:
        o = self.outcome
        return {
            "card_id": o.card_id,
            "phase": o.phase.value,
            "outcome": o.verdict.value,
            "decision": self.decision.value,
            "exit_code": self.exit_code,
            "commit": o.commit,
            "dirty": list(o.dirty),
            "items": [
                {
                    "key": v.key,
                    "text": v.text,
                    "status": v.status.value,
                    "reason": v.reason,
                    "depth": v.depth,
                    "phase": v.phase,
                    "manual": v.manual,
                    "tests": list(v.tests),
                    "hint": v.hint,
                }
                for v in o.items
            ],
            "checks": [
                {"name": c.name, "status": c.status.value, "reason": c.reason} for c in o.checks
            ],
            "gates": [g.to_dict() for g in o.thresholds],
            "red_failures": {r.key: list(r.nodeids) for r in o.red_failures},
            "evidence_dir": self.recorded.evidence_dir,
            "moved_to": self.recorded.moved_to,
            "card_paths": list(self.recorded.card_paths),
            "card_sha256": self.recorded.card_sha256,
            "committed": self.recorded.committed,
        }
