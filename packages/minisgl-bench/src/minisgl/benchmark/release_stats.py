"""A latency ratio judged over repeats: is a slowdown real, or noise?

Each side brings runs (`Observation.repeat`); a run's statistic is the policy's quantile of
its own requests. The ratio is mean(candidate runs) / mean(baseline runs), and a seeded
bootstrap over runs (resampled with replacement on each side) gives its one-sided lower bound
at the policy's confidence:

- ratio <= max_ratio (or within the slack): pass;
- ratio > max_ratio and the lower bound > 1: the candidate is slower at that confidence, by
  an estimated `ratio`: hold;
- ratio > max_ratio but the lower bound <= 1: the runs cannot tell a slowdown from noise:
  insufficient, with about how many runs a side would separate them (the interval narrows
  as 1/sqrt(runs)).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from minisgl.benchmark.common import quantile
from minisgl.benchmark.observations import Observation

BOOTSTRAP_SAMPLES = 2000
SEED = 0


@dataclass(frozen=True)
class RatioInterval:
    ratio: float
    lower: float  # one-sided lower bound at `confidence`
    confidence: float
    runs: tuple[int, int]  # (baseline, candidate)

    def runs_needed(self) -> int | None:
        """Runs a side for the lower bound to clear 1, if the estimate stays (None: it does)."""
        if self.lower > 1.0 or self.ratio <= 1.0:
            return None
        spread = self.ratio - self.lower
        n = min(self.runs)
        return max(n + 1, math.ceil(n * (spread / (self.ratio - 1.0)) ** 2))


def per_run(
    observations: Sequence[Observation], get: Callable[[Observation], Any], q: float
) -> list[float]:
    """The `q` quantile of each run's successful values (runs without values are left out)."""
    by_run: dict[int, list[float]] = defaultdict(list)
    for obs in observations:
        if not obs.ok:
            continue
        v = get(obs)
        if isinstance(v, tuple):
            by_run[obs.repeat].extend(v)
        elif v is not None:
            by_run[obs.repeat].append(float(v))
    stats = [quantile(vals, q) for _, vals in sorted(by_run.items()) if vals]
    return [s for s in stats if s is not None]


def ratio_interval(
    base: Sequence[float], cand: Sequence[float], confidence: float
) -> RatioInterval | None:
    """mean(cand) / mean(base) and its bootstrap lower bound (None without data)."""
    if not base or not cand or sum(base) <= 0:
        return None
    ratio = (sum(cand) / len(cand)) / (sum(base) / len(base))
    rng = random.Random(SEED)
    samples = []
    for _ in range(BOOTSTRAP_SAMPLES):
        b = sum(rng.choices(base, k=len(base)))
        c = sum(rng.choices(cand, k=len(cand)))
        if b > 0:
            samples.append((c / len(cand)) / (b / len(base)))
    samples.sort()
    lower = samples[int((1.0 - confidence) * (len(samples) - 1))] if samples else ratio
    return RatioInterval(ratio, lower, confidence, (len(base), len(cand)))
