"""Statistics over an A/B's repeats: pooled request latencies and a distribution-free interval
for a median.

The requests of one repeat are not independent (one burst on one server start: their times to
first token move together), so an interval is taken over the repeats' medians, the independent
units; the pooled figure is every request of every repeat, for reading the distribution.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def median_interval(
    values: Sequence[float], confidence: float = 0.95
) -> tuple[float, float] | None:
    """The order statistics (x_(j), x_(n+1-j)) bracketing the median of `values` with binomial
    coverage >= `confidence` (no assumption on the distribution); None when even the extremes
    cannot reach it (5 values or fewer at 95%)."""
    xs = sorted(values)
    n = len(xs)
    tail = (1.0 - confidence) / 2.0
    j = 0  # ranks below the interval: the largest j with P(Binomial(n, 1/2) < j + 1) <= tail
    below = 0.0
    while j < n // 2:
        below += math.comb(n, j) / 2.0**n
        if below > tail:
            break
        j += 1
    if j == 0:
        return None
    return xs[j - 1], xs[n - j]


def pooled_ttft(samples: Sequence[Sequence[float]], repeat_p50s: Sequence[float]) -> dict:
    """`samples`: each repeat's per-request TTFT (ms); `repeat_p50s`: each repeat's p50."""
    every = [x for rep in samples for x in rep]
    interval = median_interval(repeat_p50s)
    return {
        "n": len(every),
        "p50": statistics.median(every) if every else None,
        "repeat_p50_ci95": list(interval) if interval is not None else None,
    }
