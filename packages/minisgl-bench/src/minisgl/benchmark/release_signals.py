"""The release gate's evaluation: join two sets of observations, compute every signal per
segment, decide promote / hold / rollback (the CLI and report live in `release_gate.py`).

Joining: by `request_id` (or by `index`, for files from the vLLM / SGLang adapters); a request
may appear several times on a side (repeats). Segments are the candidate's backend x device;
each is compared with the baseline's observations of the same requests, under the policy's
thresholds for that segment (`Policy.for_segment`). When the candidate's observations name the
data-parallel replica that served them (`Observation.replica`, a `--dp N` server), each replica
is a segment of its own as well (`<backend>@<device> replica k`: the observations it served, the
same signals and thresholds), beside the whole backend x device: a regression in one replica is
not averaged away. A replica segment's baseline is the baseline's observations of the same
requests whatever replica served them there (a dp=1 baseline names none); a replica that served
fewer requests than `min_matched_requests` holds, and says so.

Signals and what a failure means:
- evidence (hold): matched requests, the fraction of each side's requests matched, the
  fraction of successful pairs whose outputs could be compared;
- outputs (rollback): every successful candidate observation against the baseline's
  successful ones for the request (token ids if both have them, else text, else fingerprints
  of the same kind): equal to any baseline repeat counts as a match (`match_any_baseline_repeat`,
  default true: a baseline that is not deterministic across repeats, e.g. batch-dependent int4
  kernels, sets the bar; such requests are reported); mismatched / compared above
  `max_mismatch_fraction`;
- errors (rollback): candidate error rate - baseline error rate above `max_error_rate_delta`;
- latency (hold / insufficient): the `latency.quantile` of e2e, TTFT, TPOT (decode time per
  token after the first, per request) and inter-token latency (every gap of every request
  pooled; online a gap is between stream chunks, so backends that group tokens differently
  differ here), candidate / baseline. With `latency.min_repeats` runs on each side the
  quantile and the median (`*_q0.5`) are judged over runs: the geometric mean of the runs'
  ratios, paired by repeat, with a Student-t lower bound (`release_stats.py`): hold only when
  the slowdown is real at `latency.confidence`, `insufficient` when the runs cannot tell it
  from noise (with the repeats that would); with fewer runs, the quantile's point ratio;
- kv_pressure (hold): peak and p95 of `kv_pages_in_use`, candidate / baseline;
- workload (mismatch): more than half of the requests on both sides carry different workload
  fingerprints of the same kind (`workload:` prompt ids and output length for the harness's
  observations, `lengths:` input / output lengths for vLLM / SGLang result files): the runs
  are of different workloads, its own outcome (exit 4), never promote, never a rollback; a few
  such requests are only left unmatched.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from minisgl.benchmark.common import quantile
from minisgl.benchmark.observations import Observation
from minisgl.benchmark.release_policy import Policy, Thresholds
from minisgl.benchmark.release_stats import RatioInterval, by_run, run_intervals

Decision = Literal["promote", "hold", "rollback", "mismatch", "insufficient"]
MISMATCH_FRACTION = 0.5  # shared requests whose workloads differ, above which the runs differ
JOINS = ("request_id", "index")
MEDIAN = 0.5
EXAMPLES = 5


@dataclass(frozen=True)
class Signal:
    name: str
    kind: str  # evidence | outputs | errors | latency | kv_pressure
    segment: str
    baseline: float | None
    candidate: float | None
    value: float | None  # the compared quantity: a ratio, delta or fraction
    threshold: float | None
    comparison: str  # how value meets threshold: "<=" or ">="
    ok: bool | None  # None: not evaluated (no data, not required)
    on_fail: Decision
    detail: str = ""
    examples: tuple[dict[str, Any], ...] = ()

    @property
    def failed(self) -> bool:
        return self.ok is False

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["examples"] = list(self.examples)
        return out


@dataclass(frozen=True)
class Comparison:
    """One candidate observation's output against the baseline's."""

    request: str
    unit: str | None  # "tokens", "text", "fingerprint"; None: nothing to compare
    equal: bool
    divergence: int | None = None  # first differing position (tokens / characters)


def first_divergence(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_output(base: Observation, cand: Observation, key: str) -> Comparison:
    if base.output_token_ids is not None and cand.output_token_ids is not None:
        pos = first_divergence(base.output_token_ids, cand.output_token_ids)
        return Comparison(key, "tokens", pos is None, pos)
    if base.output_text is not None and cand.output_text is not None:
        pos = first_divergence(base.output_text, cand.output_text)
        return Comparison(key, "text", pos is None, pos)
    fa, fb = base.output_fingerprint, cand.output_fingerprint
    if fa and fb and fa.split(":", 1)[0] == fb.split(":", 1)[0]:
        return Comparison(key, "fingerprint", fa == fb, None if fa == fb else 0)
    return Comparison(key, None, False)


def best_comparison(refs: Sequence[Observation], cand: Observation, key: str) -> Comparison:
    """The candidate against each reference: an equal one if any, else the latest divergence
    among the comparable ones (the closest baseline output)."""
    comps = [compare_output(r, cand, key) for r in refs]
    comparable = [c for c in comps if c.unit is not None]
    if not comparable:
        return comps[0]
    equal = next((c for c in comparable if c.equal), None)
    return equal or max(comparable, key=lambda c: c.divergence or 0)


def baseline_unstable(observations: Sequence[Observation]) -> bool:
    """True when the baseline's own successful repeats of a request produced different outputs."""
    ok = [o for o in observations if o.ok]
    comps = [compare_output(ok[0], o, "") for o in ok[1:]]
    return any(c.unit is not None and not c.equal for c in comps)


@dataclass
class Joined:
    """Both sides keyed by the join key; each key holds its observations (repeats)."""

    join: str
    baseline: dict[str, list[Observation]]
    candidate: dict[str, list[Observation]]
    conflicts: list[str] = field(default_factory=list)  # same key, different workload

    @property
    def matched(self) -> set[str]:
        return (set(self.baseline) & set(self.candidate)) - set(self.conflicts)


def join_key(obs: Observation, join: str) -> str:
    if join == "index":
        if obs.index is None:
            raise ValueError(f"request {obs.request_id!r} has no 'index' to join on")
        return str(obs.index)
    return obs.request_id


def join(baseline: list[Observation], candidate: list[Observation], how: str) -> Joined:
    if how not in JOINS:
        raise ValueError(f"unknown join {how!r} (choose from {JOINS})")
    sides: list[dict[str, list[Observation]]] = [defaultdict(list), defaultdict(list)]
    for side, observations in zip(sides, (baseline, candidate), strict=True):
        for obs in observations:
            side[join_key(obs, how)].append(obs)
        for obs_list in side.values():
            obs_list.sort(key=lambda o: o.repeat)
    conflicts = []
    for key in sorted(set(sides[0]) & set(sides[1])):
        prints = {o.workload_fingerprint for o in sides[0][key] + sides[1][key]} - {None}
        kinds = [p.split(":", 1)[0] for p in prints]  # workload:... (prompt ids), lengths:...
        if len(kinds) != len(set(kinds)):
            conflicts.append(key)
    return Joined(how, dict(sides[0]), dict(sides[1]), conflicts)


@dataclass
class SegmentResult:
    name: str
    backend: str
    device: str
    models: list[str]
    scopes: list[str]
    thresholds: Thresholds
    signals: list[Signal] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    replica: int | None = None  # a replica's segment; None: the whole backend x device

    @property
    def decision(self) -> Decision:
        return decide(self.signals)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "backend": self.backend,
            "device": self.device,
            "replica": self.replica,
            "models": self.models,
            "scopes_applied": self.scopes,
            "thresholds": asdict(self.thresholds),
            "decision": self.decision,
            "failed_signals": [s.name for s in self.signals if s.failed],
            "summary": self.summary,
        }


def decide(signals: Sequence[Signal]) -> Decision:
    failed = {s.on_fail for s in signals if s.failed}
    if "mismatch" in failed:  # runs of different workloads: nothing else can be judged
        return "mismatch"
    if "rollback" in failed:
        return "rollback"
    if "hold" in failed:
        return "hold"
    if "insufficient" in failed:  # a latency ratio the runs cannot tell from noise
        return "insufficient"
    return "promote"


def _ratio_signal(
    name: str,
    kind: str,
    segment: str,
    base: float | None,
    cand: float | None,
    max_ratio: float | None,
    slack: float,
    required: bool,
    unit: str,
) -> Signal:
    def make(value, ok, detail):
        return Signal(name, kind, segment, base, cand, value, max_ratio, "<=", ok, "hold", detail)

    if max_ratio is None:
        return make(None, None, "not checked (max_ratio: null)")
    if base is None or cand is None:
        side = "baseline" if base is None else "candidate"
        if required:
            return make(None, False, f"no {name} data on the {side} side: insufficient evidence")
        return make(None, None, f"not compared: no data on the {side} side")
    ratio = cand / base if base > 0 else (1.0 if cand == 0 else float("inf"))
    ok = ratio <= max_ratio or cand - base <= slack
    detail = f"{cand:.6g} vs {base:.6g} {unit}: {ratio:.3f}x (max {max_ratio:g}x"
    detail += f", slack {slack:g} {unit})" if slack else ")"
    return make(ratio if ratio != float("inf") else None, ok, detail)


def _latency_signals(
    name: str,
    metric: str,
    get: Callable[[Observation], Any],
    base: list[Observation],
    cand: list[Observation],
    th: Thresholds,
    key: Callable[[Observation], str],
) -> list[Signal]:
    """One latency, candidate / baseline: with `latency_min_repeats` runs a side, its policy
    quantile and its median over every request of every run (`release_stats`), else the
    quantile's point ratio."""
    q = th.latency_quantile
    max_ratio = getattr(th, f"{metric}_max_ratio")
    slack = getattr(th, f"{metric}_slack_s")
    point = _ratio_signal(f"{metric}_q{q:g}", "latency", name, quantile(_values(base, get), q),
                          quantile(_values(cand, get), q), max_ratio, slack, True, "s")  # fmt: skip
    b_runs, c_runs = by_run(base, get, key), by_run(cand, get, key)
    if max_ratio is None or min(len(b_runs), len(c_runs)) < th.latency_min_repeats:
        if point.ok is not None and max_ratio is not None:
            runs = f"; {len(b_runs)} / {len(c_runs)} run(s): one point ratio, noise not separated"
            return [replace(point, detail=point.detail + runs)]
        return [point]
    qs = _judged_quantiles(th)
    # family-wise: the segment's latency signals share the error budget (Bonferroni)
    family = len(qs) * sum(1 for m, _ in LATENCY if getattr(th, f"{m}_max_ratio") is not None)
    confidence = 1.0 - (1.0 - th.latency_confidence) / max(family, 1)
    intervals = run_intervals(b_runs, c_runs, qs, confidence)
    out = []
    for qq in qs:
        iv = intervals.get(qq)
        if iv is None:  # a run's quantile is 0 on a side (TPOT of one-chunk streams)
            p = _ratio_signal(f"{metric}_q{qq:g}", "latency", name,
                              quantile(_values(base, get), qq), quantile(_values(cand, get), qq),
                              max_ratio, slack, True, "s")  # fmt: skip
            out.append(replace(p, detail=p.detail + "; a run's value is 0 on a side: one point "
                                                    "ratio, noise not separated"))  # fmt: skip
            continue
        out.append(_interval_signal(f"{metric}_q{qq:g}", name, iv, max_ratio, slack))
    return out


def _judged_quantiles(th: Thresholds) -> tuple[float, ...]:
    """The policy quantile, and the median when it is another."""
    q = th.latency_quantile
    return (q,) if q == MEDIAN else (q, MEDIAN)


def _interval_signal(
    signal: str, segment: str, iv: RatioInterval, max_ratio: float, slack: float
) -> Signal:
    runs = f"{iv.runs[1]} / {iv.runs[0]} runs" + (", paired by repeat" if iv.paired else "")
    how = (
        f"runs' {signal.rsplit('_', 1)[1]} (geometric mean) {iv.candidate:.6g} vs "
        f"{iv.baseline:.6g} s over {runs}: {iv.ratio:.3f}x, {iv.confidence:.2%} lower bound "
        f"{iv.lower:.3f}x (max {max_ratio:g}x"
    ) + (f", slack {slack:g} s)" if slack else ")")
    within = iv.ratio <= max_ratio or iv.candidate - iv.baseline <= slack
    if within:
        outcome, ok = "hold", True
    elif iv.lower > 1.0:
        outcome, ok = "hold", False
        how += ": slower at that confidence"
    else:
        outcome, ok = "insufficient", False
        how += (
            f": cannot tell a slowdown from noise; about {iv.runs_needed()} repeats a side "
            "would separate them at this spread"
        )
    return Signal(signal, "latency", segment, iv.baseline, iv.candidate, iv.ratio, max_ratio,
                  "<=", ok, outcome, how)  # fmt: skip


def _values(observations: Sequence[Observation], get: Callable[[Observation], Any]) -> list[float]:
    out: list[float] = []
    for obs in observations:
        if not obs.ok:
            continue
        v = get(obs)
        if isinstance(v, tuple):
            out.extend(v)
        elif v is not None:
            out.append(float(v))
    return out


def tpot(obs: Observation) -> float | None:
    """Decode time per output token after the first: (e2e - TTFT) / (tokens - 1); unlike the
    pooled ITL it does not depend on how tokens were grouped into stream chunks."""
    n = obs.output_tokens if obs.output_tokens is not None else len(obs.itl_s) + 1
    if obs.e2e_s is None or obs.ttft_s is None or n < 2:
        return None
    return max(obs.e2e_s - obs.ttft_s, 0.0) / (n - 1)


LATENCY: tuple[tuple[str, Callable[[Observation], Any]], ...] = (
    ("e2e", lambda o: o.e2e_s),
    ("ttft", lambda o: o.ttft_s),
    ("tpot", tpot),
    ("itl", lambda o: o.itl_s),
)


def _summary(observations: Sequence[Observation], q: float) -> dict[str, Any]:
    n = len(observations)
    errors = sum(1 for o in observations if not o.ok)
    out: dict[str, Any] = {"observations": n, "errors": errors}
    out["error_rate"] = errors / n if n else None
    for name, get in LATENCY:
        vals = _values(observations, get)
        out[f"{name}_s"] = {
            "p50": quantile(vals, 0.5),
            f"q{q:g}": quantile(vals, q),
            "n": len(vals),
        }
    kv = _values(observations, lambda o: o.kv_pages_in_use)
    out["kv_pages_in_use"] = {"peak": max(kv) if kv else None, "p95": quantile(kv, 0.95)}
    return out


def _matched_signal(
    name: str, keys: set[str], matched: list[str], th: Thresholds, replica: Replica | None
) -> Signal:
    enough = len(matched) >= th.min_matched_requests
    if replica is None:
        detail = f"{len(matched)} of the segment's {len(keys)} request(s) found in the baseline"
    else:
        detail = (
            f"replica {replica.index} served {len(keys)} of the candidate's {replica.total} "
            f"request(s) ({len(matched)} found in the baseline)"
        )
        if not enough:
            detail += (
                f"; fewer than evidence.min_matched_requests ({th.min_matched_requests}): too "
                "few to judge this replica on its own (run more requests or repeats)"
            )
    return Signal("matched_requests", "evidence", name, None, float(len(matched)),
                  float(len(matched)), float(th.min_matched_requests), ">=", enough, "hold",
                  detail)  # fmt: skip


def _evidence_signals(
    name: str, keys: set[str], matched: list[str], th: Thresholds, replica: Replica | None
) -> list[Signal]:
    frac = len(matched) / len(keys) if keys else 0.0
    missing = sorted(keys - set(matched))
    return [
        _matched_signal(name, keys, matched, th, replica),
        Signal("candidate_match_fraction", "evidence", name, None, None, frac,
               th.min_match_fraction, ">=", frac >= th.min_match_fraction, "hold",
               f"{len(missing)} candidate request(s) missing in the baseline",
               tuple({"request": k} for k in missing[:EXAMPLES])),
    ]  # fmt: skip


def _output_signals(
    name: str, joined: Joined, cand_obs: list[tuple[str, Observation]], th: Thresholds
) -> tuple[list[Signal], dict[str, Any]]:
    """Every successful candidate observation against the baseline's first success."""
    comparisons: list[Comparison] = []
    pairs = 0
    for key, obs in cand_obs:
        refs = [b for b in joined.baseline.get(key, []) if b.ok]
        if not refs or not obs.ok or key in joined.conflicts:
            continue
        pairs += 1
        comparisons.append(best_comparison(refs if th.match_any_baseline_repeat else refs[:1],
                                           obs, key))  # fmt: skip
    unstable = sorted(k for k in joined.matched & {k for k, _ in cand_obs}
                      if baseline_unstable(joined.baseline[k]))  # fmt: skip
    compared = [c for c in comparisons if c.unit is not None]
    cfrac = len(compared) / pairs if pairs else None
    limit = th.ignore_divergence_after
    mismatched = [c for c in compared if not c.equal]
    counted = [c for c in mismatched if limit is None or (c.divergence or 0) < limit]
    mfrac = len(counted) / len(compared) if compared else 0.0
    detail = f"{len(counted)} of {len(compared)} compared output(s) differ"
    if len(mismatched) > len(counted):
        detail += f" ({len(mismatched) - len(counted)} more diverge at or after {limit}: tolerated)"
    if unstable:
        detail += (
            f"; the baseline itself gave different outputs across repeats for {len(unstable)} "
            f"request(s), e.g. {', '.join(unstable[:EXAMPLES])}"
        )
    signals = [
        Signal("outputs_compared_fraction", "evidence", name, None, None, cfrac,
               th.min_compared_fraction, ">=",
               cfrac is not None and cfrac >= th.min_compared_fraction, "hold",
               f"{len(compared)} of {pairs} successful pair(s) had comparable outputs "
               "(token ids, text, or fingerprints of the same kind on both sides)"),
        Signal("output_mismatch", "outputs", name, None, None, mfrac, th.max_mismatch_fraction,
               "<=", mfrac <= th.max_mismatch_fraction, "rollback", detail,
               tuple({"request": c.request, "unit": c.unit, "first_divergence": c.divergence}
                     for c in counted[:EXAMPLES])),
    ]  # fmt: skip
    summary = {
        "pairs": pairs,
        "compared": len(compared),
        "mismatched": len(mismatched),
        "mismatches_counted": len(counted),
        "units": sorted({c.unit for c in compared if c.unit}),
        "baseline_unstable_requests": len(unstable),
    }
    return signals, summary


def _error_signal(
    name: str, base: list[Observation], cand: list[Observation], th: Thresholds
) -> Signal:
    b_rate = sum(1 for o in base if not o.ok) / len(base) if base else None
    c_rate = sum(1 for o in cand if not o.ok) / len(cand) if cand else None
    if b_rate is None or c_rate is None:
        return Signal("error_rate", "errors", name, b_rate, c_rate, None,
                      th.max_error_rate_delta, "<=", None, "rollback",
                      "no matched observations")  # fmt: skip
    delta = c_rate - b_rate
    errs = [o for o in cand if not o.ok][:EXAMPLES]
    return Signal("error_rate", "errors", name, b_rate, c_rate, delta, th.max_error_rate_delta,
                  "<=", delta <= th.max_error_rate_delta + 1e-12, "rollback",
                  f"error rate {c_rate:.4f} vs {b_rate:.4f} (delta {delta:+.4f})",
                  tuple({"request": o.request_id, "repeat": o.repeat, "error": o.error}
                        for o in errs))  # fmt: skip


def _latency_and_kv_signals(
    name: str, base: list[Observation], cand: list[Observation], th: Thresholds, join: str
) -> list[Signal]:
    def key(o: Observation) -> str:
        return join_key(o, join)

    out = [
        s
        for metric, get in LATENCY
        for s in _latency_signals(name, metric, get, base, cand, th, key)
    ]
    bkv = _values(base, lambda o: o.kv_pages_in_use)
    ckv = _values(cand, lambda o: o.kv_pages_in_use)
    out += [
        _ratio_signal("kv_pages_peak", "kv_pressure", name, max(bkv) if bkv else None,
                      max(ckv) if ckv else None, th.kv_peak_max_ratio, 0.0, th.kv_required,
                      "pages"),
        _ratio_signal("kv_pages_p95", "kv_pressure", name, quantile(bkv, 0.95),
                      quantile(ckv, 0.95), th.kv_p95_max_ratio, 0.0, th.kv_required, "pages"),
    ]  # fmt: skip
    return out


@dataclass(frozen=True)
class Replica:
    """A replica's segment: which replica, and the requests of the whole backend x device."""

    index: int
    total: int


def evaluate_segment(
    joined: Joined,
    backend: str,
    device: str,
    cand_obs: list[tuple[str, Observation]],
    policy: Policy,
    replica: Replica | None = None,
) -> SegmentResult:
    """Every signal of one candidate segment against the baseline's same requests (`replica`:
    the observations one replica served; its baseline is the same requests' observations,
    whatever served them there). A replica that served nothing has only `matched_requests`."""
    name = f"{backend}@{device}"
    if replica is not None:
        name += f" replica {replica.index}"
    models = sorted({o.model for _, o in cand_obs})
    th, scopes = policy.for_segment(backend, device, models)
    keys = {k for k, _ in cand_obs}
    matched = sorted(keys & joined.matched)
    cand = [o for k, o in cand_obs if k in joined.matched]
    base = [o for k in matched for o in joined.baseline[k]]
    seg = SegmentResult(name, backend, device, models, scopes, th,
                        replica=None if replica is None else replica.index)  # fmt: skip
    if not cand_obs:  # a replica that served nothing: nothing else to judge it on
        seg.signals = [_matched_signal(name, keys, matched, th, replica)]
        seg.summary = {"requests": 0, "matched": 0}
        return seg
    output_signals, outputs = _output_signals(name, joined, cand_obs, th)
    seg.signals = [
        *_evidence_signals(name, keys, matched, th, replica),
        *output_signals,
        _error_signal(name, base, cand, th),
        *_latency_and_kv_signals(name, base, cand, th, joined.join),
    ]
    seg.summary = {
        "requests": len(keys),
        "matched": len(matched),
        "outputs": outputs,
        "baseline": _summary(base, th.latency_quantile),
        "candidate": _summary(cand, th.latency_quantile),
    }
    return seg


def replica_segments(
    joined: Joined,
    backend: str,
    device: str,
    cand_obs: list[tuple[str, Observation]],
    policy: Policy,
    whole: SegmentResult,
) -> list[SegmentResult]:
    """One segment per replica when the candidate's observations name replicas (every replica
    up to the count the server reported, those that served nothing included), and the split in
    `whole.summary["replicas"]`; [] when none does (dp=1, other servers)."""
    served = [o.replica for _, o in cand_obs if o.replica is not None]
    if not served:
        return []
    reported = [o.replicas for _, o in cand_obs if o.replicas is not None]
    count = max([max(served) + 1, *reported])
    total = len({k for k, _ in cand_obs})
    out, split = [], []
    for index in range(count):
        mine = [(k, o) for k, o in cand_obs if o.replica == index]
        seg = evaluate_segment(joined, backend, device, mine, policy, Replica(index, total))
        out.append(seg)
        split.append({"replica": index, "segment": seg.name,
                      "requests": seg.summary["requests"], "observations": len(mine),
                      "matched": seg.summary["matched"], "decision": seg.decision})  # fmt: skip
    whole.summary["replicas"] = {
        "replicas": count,
        "split": split,
        "unattributed_observations": len(cand_obs) - len(served),
    }
    return out


@dataclass
class Evaluation:
    decision: Decision
    signals: list[Signal]
    segments: list[SegmentResult]
    counts: dict[str, int]


def evaluate(
    baseline: list[Observation], candidate: list[Observation], policy: Policy, how: str
) -> Evaluation:
    joined = join(baseline, candidate, how)
    by_segment: dict[tuple[str, str], list[tuple[str, Observation]]] = defaultdict(list)
    for key, observations in sorted(joined.candidate.items()):
        for obs in observations:
            by_segment[(obs.backend, obs.device)].append((key, obs))
    segments = []
    for (backend, device), obs in sorted(by_segment.items()):
        whole = evaluate_segment(joined, backend, device, obs, policy)
        segments += [whole, *replica_segments(joined, backend, device, obs, policy, whole)]
    matched = joined.matched
    th = policy.base
    missing_b = sorted(set(joined.baseline) - matched)
    frac = len(matched) / len(joined.baseline) if joined.baseline else 0.0
    detail = f"{len(missing_b)} baseline request(s) not matched in the candidate"
    if joined.conflicts:
        detail += (
            f" ({len(joined.conflicts)} present on both sides with a different workload "
            "fingerprint: other prompts or lengths under the same id)"
        )
    shared = set(joined.baseline) & set(joined.candidate)
    cfrac = len(joined.conflicts) / len(shared) if shared else 0.0
    signals = [
        Signal("baseline_match_fraction", "evidence", "all", None, None, frac,
               th.min_match_fraction, ">=", frac >= th.min_match_fraction, "hold", detail,
               tuple({"request": k} for k in missing_b[:EXAMPLES])),
        Signal("workload_conflict_fraction", "workload", "all", None, None, cfrac,
               MISMATCH_FRACTION, "<=", cfrac <= MISMATCH_FRACTION, "mismatch",
               f"{len(joined.conflicts)} of {len(shared)} request(s) on both sides differ in "
               "their workload (prompt, or input / output lengths): the runs are of different "
               "workloads; compare runs of the same workload",
               tuple({"request": k} for k in joined.conflicts[:EXAMPLES])),
    ]  # fmt: skip
    if not segments:
        signals.append(
            Signal("matched_requests", "evidence", "all", None, 0.0, 0.0,
                   float(th.min_matched_requests), ">=", False, "hold",
                   "the candidate has no observations")
        )  # fmt: skip
    for seg in segments:
        signals.extend(seg.signals)
    counts = {
        "baseline_observations": len(baseline),
        "candidate_observations": len(candidate),
        "baseline_requests": len(joined.baseline),
        "candidate_requests": len(joined.candidate),
        "matched": len(matched),
        "missing_in_candidate": len(missing_b),
        "missing_in_baseline": len(set(joined.candidate) - matched),
        "workload_conflicts": len(joined.conflicts),
    }
    return Evaluation(decide(signals), signals, segments, counts)


NEXT_ACTIONS = {
    "workload": "the two runs are of different workloads (other prompts or lengths under the "
    "same ids): run baseline and candidate with the same profile, seed and lengths, then gate "
    "again",
    "evidence": "rerun baseline and candidate on the same workload (same profile and seed, so "
    "request ids join) with enough requests; then gate again",
    "outputs": "diff the listed requests (first divergence) between baseline and candidate, "
    "rerun token parity on them (minisgl.benchmark.token_parity); keep the baseline backend "
    "as the default until outputs match",
    "errors": "read the candidate's error messages (examples) and its server log; fix and "
    "rerun; keep the baseline backend as the default",
    "latency": "rerun with more repeats (ABBA order) to separate noise from regression; if it "
    "persists, profile the candidate on this metric; promote only within the threshold",
    "kv_pressure": "compare KV pages per request (prefix cache hits, page leaks, kv_integrity) "
    "between the backends before promoting",
}
RESPONSES = {
    "rollback": "roll back: keep (or switch back to) the baseline backend",
    "hold": "hold: do not promote; keep the current default",
    "mismatch": "nothing decided: the runs do not measure the same workload; keep the current "
    "default",
    "insufficient": "not enough evidence: rerun both sides with the repeats the detail names "
    "(ABBA order), then gate again; keep the current default meanwhile",
}


def triage(signals: Sequence[Signal]) -> list[dict[str, Any]]:
    """One item per failed signal, a workload mismatch first, then rollbacks."""
    order = {"mismatch": 0, "rollback": 1, "hold": 2, "insufficient": 3}
    failed = sorted(
        (s for s in signals if s.failed), key=lambda s: (order.get(s.on_fail, 2), s.segment)
    )
    return [
        {
            "signal": s.name,
            "kind": s.kind,
            "segment": s.segment,
            "baseline": s.baseline,
            "candidate": s.candidate,
            "value": s.value,
            "threshold": s.threshold,
            "comparison": s.comparison,
            "response": s.on_fail,
            "recommended_response": RESPONSES[s.on_fail],
            "next_action": NEXT_ACTIONS[s.kind],
            "detail": s.detail,
            "examples": list(s.examples),
        }
        for s in failed
    ]
