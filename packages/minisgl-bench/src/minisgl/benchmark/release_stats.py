"""A latency ratio judged over repeats: is a slowdown real, or noise?

Each side brings runs (`Observation.repeat`) of the same requests; the quantiles judged are the
policy's and the median, each computed per run over every successful request of the run. When
both sides hold the same repeat numbers the runs are **paired**: run r of the candidate against
run r of the baseline, on the requests both have, d_r = log(Q(candidate r) / Q(baseline r)).
Pairing cancels what the two sides' run r share: the harness's ABBA order (and
`tools/ci/release_trial.py`'s) puts them next to each other in time (the machine's drift under
other work), the first run of a harness process is slower on both sides (the client's warm-up:
1.3-1.6x the median on the AMD EPYC box), and each run is one closed-loop workload (a request's
place in it sets its wait). The ratio is exp(mean d_r), the geometric mean of the pairs'
ratios, and its one-sided lower bound at the policy's confidence is Student's t on the d_r
(n - 1 degrees of freedom). Sides with other repeat numbers are not paired: the logs of each
side's run quantiles, Welch's t.

- ratio <= max_ratio (or within the slack): pass;
- ratio > max_ratio and the lower bound > 1: the candidate is slower at that confidence, by
  an estimated `ratio`: hold;
- ratio > max_ratio but the lower bound <= 1: the runs cannot tell a slowdown from noise:
  insufficient, with about how many runs a side would separate them (the interval narrows
  as 1/sqrt(runs)).

Issue 41's real trial chose this (`docs/release_gate.md`). mean(candidate runs' q) /
mean(baseline runs' q) with a bootstrap over runs, unpaired, let the slow first run of each side
spread the runs wider than a 20% slowdown (lower bounds 0.4-0.6x at 8 requests a run). Pooling
every run's requests into one quantile let the slow first run supply the whole tail (identical
builds at 1.10-1.17x). A two-stage bootstrap (runs, then requests) of the paired ratio held
identical builds in 2 of 10 real decisions on a loaded machine: with 3 runs the bootstrap's lower
bound is about the smallest pair's ratio, and 3 pairs above 1 happen 1 time in 8 by chance.
Student's t is exact for normal d_r and wide with few runs, as it must be: 3 runs a side hold
only a slowdown far beyond the runs' spread; 6-8 interleaved runs resolve 20% at a run-to-run
spread of about 8%.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from minisgl.benchmark.observations import Observation

# one side's values of one latency: repeat -> request key -> the request's values
Runs = Mapping[int, Mapping[str, Sequence[float]]]
SIMPSON_STEPS = 400


@dataclass(frozen=True)
class RatioInterval:
    ratio: float
    lower: float  # one-sided lower bound at `confidence`
    confidence: float
    runs: tuple[int, int]  # (baseline, candidate)
    paired: bool = False  # runs compared as pairs of the same repeat number
    baseline: float = 0.0  # geometric mean of the runs' quantiles
    candidate: float = 0.0
    run_ratios: tuple[float, ...] = ()  # paired: each pair's ratio, in repeat order

    def runs_needed(self) -> int | None:
        """Runs a side for the lower bound to clear 1, if the estimate stays (None: it does)."""
        if self.lower > 1.0 or self.ratio <= 1.0:
            return None
        spread = self.ratio - self.lower
        n = min(self.runs)
        return max(n + 1, math.ceil(n * (spread / (self.ratio - 1.0)) ** 2))


def by_run(
    observations: Sequence[Observation],
    get: Callable[[Observation], Any],
    key: Callable[[Observation], str] = lambda o: o.request_id,
) -> dict[int, dict[str, tuple[float, ...]]]:
    """Each run's successful values by request `key` (the join key; `get` returns a number, a
    tuple, or None)."""
    out: dict[int, dict[str, tuple[float, ...]]] = defaultdict(dict)
    for obs in observations:
        if not obs.ok:
            continue
        v = get(obs)
        vals = (
            tuple(float(x) for x in v)
            if isinstance(v, tuple)
            else (() if v is None else (float(v),))
        )
        if vals:
            out[obs.repeat][key(obs)] = vals
    return dict(out)


def run_intervals(
    base: Runs, cand: Runs, quantiles: Sequence[float], confidence: float
) -> dict[float, RatioInterval]:
    """For each quantile q: the candidate / baseline ratio of the runs' q, paired by repeat
    number when both sides hold the same ones (on the requests both runs of a pair have), and
    its Student-t lower bound. Quantiles without two runs a side with a positive q are left out."""
    b_runs = {r: run for r, run in base.items() if run}
    c_runs = {r: run for r, run in cand.items() if run}
    paired = bool(b_runs) and sorted(b_runs) == sorted(c_runs)
    if paired:
        shared = {r: set(b_runs[r]) & set(c_runs[r]) for r in b_runs}
        paired = all(shared.values())
    out: dict[float, RatioInterval] = {}
    for q in quantiles:
        if paired:
            pairs = [(_run_quantile(b_runs[r], q, shared[r]), _run_quantile(c_runs[r], q,
                      shared[r])) for r in sorted(b_runs)]  # fmt: skip
            if len(pairs) < 2 or any(b <= 0 or c <= 0 for b, c in pairs):
                continue
            d = [math.log(c / b) for b, c in pairs]
            mean, se, df = statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d)), len(d) - 1
            b_log = statistics.fmean(math.log(b) for b, _ in pairs)
            ratios = tuple(c / b for b, c in pairs)
        else:
            bl = [math.log(x) for x in (_run_quantile(r, q) for r in b_runs.values()) if x > 0]
            cl = [math.log(x) for x in (_run_quantile(r, q) for r in c_runs.values()) if x > 0]
            if len(bl) < 2 or len(cl) < 2:
                continue
            vb, vc = statistics.variance(bl) / len(bl), statistics.variance(cl) / len(cl)
            mean, se = statistics.fmean(cl) - statistics.fmean(bl), math.sqrt(vb + vc)
            df = (vb + vc) ** 2 / (vb**2 / (len(bl) - 1) + vc**2 / (len(cl) - 1)) if se else 1
            b_log, ratios = statistics.fmean(bl), ()
        lower = math.exp(mean - t_quantile(confidence, df) * se)
        out[q] = RatioInterval(math.exp(mean), lower, confidence, (len(b_runs), len(c_runs)),
                               paired, math.exp(b_log), math.exp(b_log + mean), ratios)  # fmt: skip
    return out


def _run_quantile(
    run: Mapping[str, Sequence[float]], q: float, keys: set[str] | None = None
) -> float:
    xs = sorted(v for k, vals in run.items() if keys is None or k in keys for v in vals)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, df: float) -> float:
    """Student's t quantile for 0.5 <= p < 1 (df > 0, not necessarily whole): the CDF integrated
    in theta = atan(t / sqrt(df)), where the density is c * cos(theta) ** (df - 1), by Simpson's
    rule, and the quantile found by bisection."""
    if not 0.5 <= p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df > 0, got p={p}, df={df}")
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)

    def mass(theta: float) -> float:  # P(0 < T < sqrt(df) tan(theta))
        h = theta / SIMPSON_STEPS
        total = 1.0 + math.cos(theta) ** (df - 1)
        for i in range(1, SIMPSON_STEPS):
            total += (4 if i % 2 else 2) * math.cos(i * h) ** (df - 1)
        return c * total * h / 3

    lo, hi = 0.0, math.pi / 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mass(mid) < p - 0.5 else (lo, mid)
    return math.sqrt(df) * math.tan((lo + hi) / 2)
