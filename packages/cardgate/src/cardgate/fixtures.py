"""The fixtures a bound test uses to leave evidence: `metric`, `parity`, `release_gate`.

The gate refuses a run where any of them comes from elsewhere (a conftest that scales every
metric): `inventory.fixture_overrides`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cardgate.parity import ParityResult, assert_parity_json
from cardgate.release import ReleaseResult, check_release_json, failure_message

METRIC_PROP = "cardgate_metric"


class MetricRecorder:
    """`metric(name, value, unit="", higher_is_better=True)`: record one benchmark metric."""

    def __init__(self, node: pytest.Item) -> None:
        self._node = node

    def __call__(
        self, name: str, value: float, unit: str = "", higher_is_better: bool = True
    ) -> float:
        if not isinstance(name, str) or not name.strip():
            raise ValueError("metric name must be a non-empty string")
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"metric {name!r} is not finite: {value!r}")
        if any(k == METRIC_PROP and v["name"] == name for k, v in self._node.user_properties):
            raise ValueError(f"metric {name!r} recorded twice by {self._node.nodeid}")
        record = {"name": name, "value": number, "unit": unit, "higher_is_better": higher_is_better}
        self._node.user_properties.append((METRIC_PROP, record))
        return number


@pytest.fixture
def metric(request: pytest.FixtureRequest) -> MetricRecorder:
    """Record benchmark metrics from a test marked `@pytest.mark.bench`."""
    node = request.node
    if node.get_closest_marker("bench") is None:
        pytest.fail("the metric fixture is for tests marked @pytest.mark.bench", pytrace=False)
    return MetricRecorder(node)


@pytest.fixture
def parity(request: pytest.FixtureRequest) -> Iterator[Any]:
    """`parity(path)`: fail unless the parity JSON passed; records `parity_mismatches`."""

    def check(path: Path | str, metric_name: str = "parity_mismatches") -> ParityResult:
        result = assert_parity_json(path)
        recorder = MetricRecorder(request.node)
        recorder(metric_name, float(result.mismatches or 0), unit="count", higher_is_better=False)
        return result

    yield check


@pytest.fixture
def release_gate(request: pytest.FixtureRequest) -> Iterator[Any]:
    """`release_gate(path)`: fail unless the release-gate report's decision is `promote`;
    records `release_decision` (0 promote, 1 hold, 2 rollback; lower is better) whenever the
    report has a decision, so a hold or rollback is evidence too."""

    def check(path: Path | str, metric_name: str = "release_decision") -> ReleaseResult:
        result = check_release_json(path)
        if result.code is not None:
            recorder = MetricRecorder(request.node)
            recorder(metric_name, float(result.code), unit="decision", higher_is_better=False)
        if not result.passed:
            raise AssertionError(failure_message(result))
        return result

    yield check
