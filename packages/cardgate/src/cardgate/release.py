"""Release-gate evidence: a release-gate report (`python -m minisgl.benchmark.release_gate
--out R.json`) whose decision is `promote`.

    from cardgate.release import assert_release_json
    assert_release_json("worklog/baselines/release-online.json")

The report is read as JSON (cardgate does not import minisgl): `decision` must be one of
promote / hold / rollback / mismatch / insufficient and agree with `exit_code` when present
(0 / 1 / 2 / 4 / 5: mismatch means the two runs were of different workloads, insufficient that
their repeats could not tell a latency regression from noise); anything but
promote fails, with the report's `reasons`. `check_release_json` never raises: a missing or
malformed file is a failed result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cardgate.parity import read_json_report

DECISIONS = {"promote": 0, "hold": 1, "rollback": 2, "mismatch": 4, "insufficient": 5}


@dataclass
class ReleaseResult:
    path: str
    passed: bool
    decision: str | None
    reasons: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def code(self) -> int | None:
        """0 promote, 1 hold, 2 rollback, 4 mismatch, 5 insufficient; None when unknown."""
        return DECISIONS.get(self.decision or "")


def check_release_json(path: Path | str) -> ReleaseResult:
    """Read a release-gate report; never raises (a missing or bad file is a failed result)."""
    where = str(path)
    data, error = read_json_report(path, "release-gate report")
    if data is None:
        return ReleaseResult(where, False, None, [str(error)])
    decision = data.get("decision")
    if decision not in DECISIONS:
        return ReleaseResult(
            where, False, None, [f"decision is {decision!r}, expected one of {sorted(DECISIONS)}"]
        )
    reasons: list[str] = []
    code = data.get("exit_code")
    if code is not None and code != DECISIONS[decision]:
        reasons.append(f"exit_code {code!r} disagrees with decision {decision!r}")
    if decision != "promote":
        given = data.get("reasons")
        detail = [str(r) for r in given] if isinstance(given, list) else []
        reasons.append(f"decision is {decision!r}, expected 'promote'")
        reasons.extend(detail)
    return ReleaseResult(where, not reasons, decision, reasons, data)


def failure_message(result: ReleaseResult) -> str:
    return f"release gate failed for {result.path}: " + "; ".join(result.reasons)


def assert_release_json(path: Path | str) -> ReleaseResult:
    """`check_release_json` that fails the calling test with every reason."""
    result = check_release_json(path)
    if not result.passed:
        raise AssertionError(failure_message(result))
    return result
