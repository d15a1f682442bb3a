"""Parity evidence: a JSON report with `parity_passed: true` and zero mismatches.

    from cardgate.parity import assert_parity_json
    assert_parity_json("worklog/baselines/parity.json")

Mismatch fields: `mismatches`, `num_mismatches`, `divergences` (a count, or a list / mapping
of the mismatches). At least one must be present and every one present must be zero (`0`,
`0.0` or empty); `mismatches: 0` next to a non-empty `divergences` list fails.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MISMATCH_KEYS = ("mismatches", "num_mismatches", "divergences")


@dataclass
class ParityResult:
    path: str
    passed: bool
    mismatches: int | None
    reasons: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)


def _count(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, list | dict):
        return len(value)
    return None


def read_json_report(path: Path | str, what: str) -> tuple[dict[str, Any] | None, str | None]:
    """The JSON object in `path`, or None and why (`what` names the report); never raises."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"cannot read {what}: {exc}"
    if not isinstance(data, dict):
        return None, f"{what} is not a JSON object"
    return data, None


def check_parity_json(path: Path | str) -> ParityResult:
    """Read a parity report; never raises (a missing or bad file is a failed result)."""
    where = str(path)
    data, error = read_json_report(path, "parity report")
    if data is None:
        return ParityResult(where, False, None, [str(error)])
    reasons: list[str] = []
    if data.get("parity_passed") is not True:
        reasons.append(f"parity_passed is {data.get('parity_passed')!r}, expected true")
    mismatches: int | None = None
    present = [key for key in MISMATCH_KEYS if key in data]
    for key in present:
        count = _count(data[key])
        if count is None:
            reasons.append(f"{key} is {data[key]!r}: expected a count or a list")
            continue
        mismatches = max(mismatches or 0, count)
        if count != 0:
            reasons.append(f"{key} = {count}, expected 0")
    if not present:
        reasons.append(f"no mismatch count ({', '.join(MISMATCH_KEYS)}) in the report")
    return ParityResult(where, not reasons, mismatches, reasons, data)


def assert_parity_json(path: Path | str) -> ParityResult:
    """`check_parity_json` that fails the calling test with every reason."""
    result = check_parity_json(path)
    if not result.passed:
        raise AssertionError(f"parity failed for {result.path}: " + "; ".join(result.reasons))
    return result
