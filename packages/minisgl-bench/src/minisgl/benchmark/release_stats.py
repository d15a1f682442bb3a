"""A latency ratio judged over repeats: is a slowdown real, or noise?

Each side brings runs (`Observation.repeat`) of the same requests; the quantiles judged are the
policy's and the median. When both sides hold the same repeat numbers the runs are **paired**:
run r of the candidate against run r of the baseline, on the requests both of them have, and
the ratio is the geometric mean over pairs of Q(candidate run r) / Q(baseline run r). Pairing
cancels what the two sides' run r share: the harness's ABBA order (and `release_trial`'s) puts
them next to each other in time (the machine's drift under other work), the first run of a
harness process is slower on both sides (the client's warm-up: 1.3-1.6x the median on the AMD
EPYC box), and every run is one closed-loop workload (a request's place in it sets its wait).
Sides with other repeat numbers are not paired: the ratio is then of the runs' geometric means.

The ratio's one-sided lower bound at the policy's confidence comes from a seeded two-stage
(cluster) bootstrap: draw runs (pairs) with replacement, then requests with replacement within
each drawn run (the same requests on both sides of a pair), and recompute the ratio.

- ratio <= max_ratio (or within the slack): pass;
- ratio > max_ratio and the lower bound > 1: the candidate is slower at that confidence, by
  an estimated `ratio`: hold;
- ratio > max_ratio but the lower bound <= 1: the runs cannot tell a slowdown from noise:
  insufficient, with about how many runs a side would separate them (the interval narrows
  as 1/sqrt(runs)).

Before issue 41's real trial the gate took mean(candidate runs' q) / mean(baseline runs' q) and
bootstrapped runs only, unpaired: the slow first run of each side then spread the runs wider
than a 20% slowdown (lower bounds 0.4-0.6x at 8 requests a run). Pooling every run's requests
into one quantile was tried too: the slow first run then supplies the whole tail, and identical
builds came out 1.10-1.17x (3 of 20 'insufficient' on such runs); one ratio per pair weighs
every run alike.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from minisgl.benchmark.observations import Observation

BOOTSTRAP_SAMPLES = 2000
SEED = 0
# values drawn a replicate (both sides) above which fewer replicates are drawn (pooled ITL
# gaps: ~60 a request), never fewer than MIN_SAMPLES
WORK_PER_SAMPLE = 4096
MIN_SAMPLES = 400

# one side's values of one latency: repeat -> request key -> the request's values
Runs = Mapping[int, Mapping[str, Sequence[float]]]


@dataclass(frozen=True)
class RatioInterval:
    ratio: float
    lower: float  # one-sided lower bound at `confidence`
    confidence: float
    runs: tuple[int, int]  # (baseline, candidate)
    paired: bool = False  # runs compared as pairs of the same repeat number
    baseline: float = 0.0  # geometric mean of the runs' quantiles
    candidate: float = 0.0

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


def cluster_intervals(
    base: Runs,
    cand: Runs,
    quantiles: Sequence[float],
    confidence: float,
    samples: int = BOOTSTRAP_SAMPLES,
    seed: int = SEED,
) -> dict[float, RatioInterval]:
    """For each quantile q: the candidate / baseline ratio of the runs' q (paired by repeat
    number when both sides hold the same ones) and its two-stage bootstrap lower bound.
    Quantiles without data or with a zero on a side are left out."""
    b_runs = {r: dict(run) for r, run in base.items() if run}
    c_runs = {r: dict(run) for r, run in cand.items() if run}
    if not b_runs or not c_runs:
        return {}
    pairs = sorted(b_runs) == sorted(c_runs)
    if pairs:  # each pair on the requests both of its runs have
        for r in b_runs:
            shared = set(b_runs[r]) & set(c_runs[r])
            b_runs[r] = {k: v for k, v in b_runs[r].items() if k in shared}
            c_runs[r] = {k: v for k, v in c_runs[r].items() if k in shared}
        pairs = all(b_runs.values())
        if not pairs:
            b_runs = {r: dict(run) for r, run in base.items() if run}
            c_runs = {r: dict(run) for r, run in cand.items() if run}
    b_point, c_point = _log_quantiles(b_runs, quantiles), _log_quantiles(c_runs, quantiles)
    width = sum(len(v) for side in (b_runs, c_runs) for run in side.values() for v in run.values())
    samples = max(min(samples, MIN_SAMPLES), min(samples, samples * WORK_PER_SAMPLE // width))
    rng = random.Random(seed)
    draws: dict[float, list[float]] = {q: [] for q in quantiles}
    for _ in range(samples):
        if pairs:
            bd, cd = _draw_pairs(rng, b_runs, c_runs)
        else:
            bd, cd = _draw(rng, b_runs), _draw(rng, c_runs)
        b_log, c_log = _log_quantiles(bd, quantiles), _log_quantiles(cd, quantiles)
        for q in quantiles:
            if q in b_log and q in c_log:
                draws[q].append(math.exp(c_log[q] - b_log[q]))
    out: dict[float, RatioInterval] = {}
    for q in quantiles:
        if q not in b_point or q not in c_point:
            continue
        ratio = math.exp(c_point[q] - b_point[q])
        ratios = sorted(draws[q])
        lower = ratios[int((1.0 - confidence) * (len(ratios) - 1))] if ratios else ratio
        out[q] = RatioInterval(ratio, lower, confidence, (len(b_runs), len(c_runs)), pairs,
                               math.exp(b_point[q]), math.exp(c_point[q]))  # fmt: skip
    return out


def _log_quantiles(
    runs: Mapping[int, Mapping[str, Sequence[float]]] | Sequence[list[float]],
    quantiles: Sequence[float],
) -> dict[float, float]:
    """For each q: the mean over runs of log(the run's q) (left out when a run's q is not
    positive). Takes runs by repeat, or a list of each run's drawn values."""
    values = [
        sorted(v for vals in run.values() for v in vals) for run in runs.values()
    ] if isinstance(runs, Mapping) else [sorted(run) for run in runs]  # fmt: skip
    out: dict[float, float] = {}
    for q in quantiles:
        stats = [_sorted_quantile(xs, q) for xs in values if xs]
        if stats and all(x > 0 for x in stats):
            out[q] = sum(math.log(x) for x in stats) / len(stats)
    return out


def _draw(
    rng: random.Random, runs: Mapping[int, Mapping[str, Sequence[float]]]
) -> list[list[float]]:
    """One side on its own: runs with replacement, then requests within each."""
    order = sorted(runs)
    out = []
    for _ in order:
        run = runs[order[rng.randrange(len(order))]]
        names = list(run)
        out.append([v for k in rng.choices(names, k=len(names)) for v in run[k]])
    return out


def _draw_pairs(
    rng: random.Random,
    base: Mapping[int, Mapping[str, Sequence[float]]],
    cand: Mapping[int, Mapping[str, Sequence[float]]],
) -> tuple[list[list[float]], list[list[float]]]:
    """Both sides together: repeat numbers with replacement, then the same requests of each."""
    order = sorted(base)
    vb: list[list[float]] = []
    vc: list[list[float]] = []
    for _ in order:
        r = order[rng.randrange(len(order))]
        b, c = base[r], cand[r]
        names = list(b)
        picked = rng.choices(names, k=len(names))
        vb.append([v for k in picked for v in b[k]])
        vc.append([v for k in picked for v in c[k]])
    return vb, vc


def _sorted_quantile(xs: Sequence[float], q: float) -> float:
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
