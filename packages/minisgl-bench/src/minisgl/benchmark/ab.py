"""The one A/B driver of the benchmark tools: arms run interleaved over repeats (ABBA order, so
a slow drift of the machine falls on every arm alike), each arm's median over its repeats, and
every other arm against the first (the ratio of the medians, and the median of the ratios
paired within a repeat). The tools (`online_ab`, `structured_ab`, `dp_ab`, the harness's offline
`--ab`; `tp_ab` and `overlap_ab` through `llm_ab`) say what one run of an arm is, which keys
they pair and the fields of their JSON."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from minisgl.benchmark import common
from minisgl.benchmark.profiles import Profile, build_workload, warmup_workload
from minisgl.benchmark.record import RATIO_KEYS, median_nested

T = TypeVar("T")
Metrics = dict[str, Any]


def interleave(
    arms: Sequence[str], repeats: int, run: Callable[[str, int], T]
) -> dict[str, list[T]]:
    """`run(arm, repeat)` for every arm in each repeat, in ABBA order; each arm's outputs in
    repeat order."""
    outs: dict[str, list[T]] = {arm: [] for arm in arms}
    for rep in range(repeats):
        for arm in common.abba_order(arms, rep):
            print(f"[ab] repeat {rep + 1}/{repeats}: {arm}", file=sys.stderr, flush=True)
            outs[arm].append(run(arm, rep))
    return outs


def key_medians(keys: Sequence[str]) -> Callable[[list[Metrics]], Metrics]:
    """A median over repeats of just `keys` (top-level numbers), for `compare`."""
    return lambda reps: {k: common.median(r[k] for r in reps) for k in keys}


@dataclass(frozen=True)
class Comparison:
    """Each arm's repeats and median, and every arm after the first against the first."""

    runs: dict[str, list[Metrics]]
    medians: dict[str, Metrics]
    ratio: dict[str, dict[str, float]]  # arm -> arm / base of the medians
    paired: dict[str, dict[str, Any]]  # arm -> median of per-repeat ratios, and the ratios

    def results(self) -> dict[str, Metrics]:
        return {a: {"metrics": self.medians[a], "repeats": self.runs[a]} for a in self.runs}

    def gate_metrics(self, arm_names: bool = True) -> dict[str, float]:
        """`ab.<arm>.<metric>` of each arm's median, `ab_ratio[_paired].<arm>.<key>` of the
        others (`ab_ratio.<key>` without `arm_names`)."""
        out: dict[str, float] = {}
        for arm, med in self.medians.items():
            out.update(common.flatten(med, f"ab.{arm}."))
        for arm in self.ratio:
            name = f"{arm}." if arm_names else ""
            out.update(common.flatten(self.ratio[arm], f"ab_ratio.{name}"))
            out.update(common.flatten(self.paired[arm], f"ab_ratio_paired.{name}"))
        return out

    def tables(self) -> dict[str, dict[str, float]]:
        """The ratios as `report.print_summary` tables."""
        out: dict[str, dict[str, float]] = {}
        base = next(iter(self.runs))
        for arm in self.ratio:
            out[f"{arm} / {base} (ratio of medians)"] = self.ratio[arm]
            out[f"{arm} / {base} (median of paired repeats)"] = {
                k: v for k, v in self.paired[arm].items() if not k.endswith("_per_repeat")
            }
        return out


def compare(
    runs: Mapping[str, list[Metrics]],
    ratio_keys: Sequence[str] = RATIO_KEYS,
    paired_keys: Sequence[str] = (),
    median: Callable[[list[Metrics]], Metrics] = median_nested,
) -> Comparison:
    """Each arm's `median` of its repeats; the first arm is the base of the ratios (dotted
    `ratio_keys` of the medians, `paired_keys` paired within each repeat)."""
    medians = {arm: median(reps) for arm, reps in runs.items()}
    base, *others = runs
    return Comparison(
        dict(runs),
        medians,
        {a: common.ratios(medians[base], medians[a], ratio_keys) for a in others},
        {a: common.paired_ratios(runs[base], runs[a], paired_keys) for a in others},
    )


def llm_ab(
    kind: str,
    argv: Sequence[str] | None,
    llms: Mapping[str, Any],
    profile: Profile,
    repeats: int,
    paired_keys: Sequence[str],
    warmed: Callable[[], object] | None = None,
) -> tuple[Metrics, Comparison, dict[str, list[Metrics]]]:
    """Offline A/B of one `LLM` per arm on `profile`'s requests (all at t=0), each warmed once
    on its warm-up workload (`warmed()` after that), the LLMs closed at the end. Returns the
    record's common fields, the comparison of the arms' metrics and each arm's outputs."""
    from minisgl.benchmark.offline import run_minisgl

    try:
        vocab = next(iter(llms.values())).engine.model_config.vocab_size
        items, warm = build_workload(profile, vocab), warmup_workload(profile, vocab)
        load0 = os.getloadavg()
        for llm in llms.values():
            run_minisgl(llm, warm, honor_arrivals=False)
        if warmed is not None:
            warmed()
        t0 = time.perf_counter()
        outs = interleave(
            list(llms), repeats, lambda a, _: run_minisgl(llms[a], items, honor_arrivals=False)
        )
        wall = time.perf_counter() - t0
    finally:
        for llm in llms.values():
            llm.close()
    cmp = compare({a: [o["metrics"] for o in outs[a]] for a in outs}, RATIO_KEYS, paired_keys)
    for arm, m in cmp.medians.items():
        print(f"{arm:8s} {m['output_tok_s']:9.1f} out tok/s  e2e p50 {m['e2e_ms']['p50']:8.1f} ms"
              f"  tpot p50 {m['tpot_ms']['p50']:7.2f} ms  steps {m['steps']}")  # fmt: skip
    record = {
        **common.record_header(kind, argv),
        "loadavg_before_after": [list(load0), list(os.getloadavg())],
        "wall_s": wall,
        "profile": profile.to_dict(),
        "repeats": repeats,
        "results": cmp.results(),
    }
    return record, cmp, outs


def write(path: str | None, record: Metrics) -> None:
    """The record as JSON at `path` (`common.write_json`), if one was given."""
    if path:
        common.write_json(path, record)
        print(f"wrote {path}")
