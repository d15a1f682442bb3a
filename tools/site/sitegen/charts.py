"""Charts drawn at build time with matplotlib (Agg), returned as PNG bytes."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from sitegen.data import Baseline, HistoryPoint

PALETTE = ("#3f51b5", "#e91e63", "#009688", "#ff9800", "#795548", "#607d8b", "#9c27b0")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    # no timestamps in the PNG metadata: the same data gives the same bytes
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    _pyplot().close(fig)
    return buf.getvalue()


def history_chart(metric: str, machine_class: str, points: Sequence[HistoryPoint]) -> bytes:
    """One metric on one machine class across commits: a line per series, dashed thresholds."""
    plt = _pyplot()
    stops = sorted({(p.utc, p.commit) for p in points})
    position = {stop: i for i, stop in enumerate(stops)}
    fig, ax = plt.subplots(figsize=(7.5, 3.2), layout="constrained")
    series = sorted({p.series for p in points})
    for index, name in enumerate(series):
        mine = sorted((p for p in points if p.series == name), key=lambda p: (p.utc, p.commit))
        color = PALETTE[index % len(PALETTE)]
        xs = [position[(p.utc, p.commit)] for p in mine]
        ax.plot(xs, [p.value for p in mine], marker="o", color=color, label=name)
        limits = [(x, p.threshold) for x, p in zip(xs, mine, strict=True) if p.threshold]
        if limits:
            ax.plot(
                [x for x, _ in limits],
                [t for _, t in limits],
                linestyle="--",
                marker="_",
                markersize=14,
                color=color,
                label=f"{name} threshold",
            )
    values = [p.value for p in points] + [p.threshold for p in points if p.threshold]
    positive = [v for v in values if v and v > 0]
    if positive and len(positive) == len(values) and max(positive) / min(positive) > 50:
        ax.set_yscale("log")
    ax.set_xticks(range(len(stops)))
    ax.set_xticklabels([f"{c[:7]}\n{u[:10]}" for u, c in stops], fontsize=7)
    ax.set_xlim(-0.5, max(len(stops) - 0.5, 0.5))
    ax.set_title(f"{metric} · {machine_class}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return _png(fig)


def _bars(title: str, labels: list[str], groups: dict[str, list[float]], ylabel: str) -> bytes:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.2), layout="constrained")
    width = 0.8 / max(len(groups), 1)
    for index, (name, values) in enumerate(groups.items()):
        xs = [i + (index - (len(groups) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, values, width=width, label=name, color=PALETTE[index % len(PALETTE)])
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7, rotation=20, ha="right")
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    if len(groups) > 1:
        ax.legend(fontsize=7)
    return _png(fig)


def _pair_bars(title: str, rows: dict[str, dict], *bars: tuple[str, str]) -> bytes:
    """Bars in seconds of each row's fields: (legend, key) per bar group."""
    labels = list(rows)
    groups = {name: [float(rows[k].get(key) or 0.0) for k in labels] for name, key in bars}
    return _bars(title, labels, groups, "s")


def _engine_metrics(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    results = data.get("results")
    if not isinstance(results, dict):
        return {}
    return {
        str(name): r["metrics"]
        for name, r in results.items()
        if isinstance(r, dict) and isinstance(r.get("metrics"), dict)
    }


def _pct(metrics: dict[str, Any], name: str, q: str = "p50") -> float:
    value = metrics.get(name)
    if isinstance(value, dict):
        value = value.get(q)
    return float(value) if isinstance(value, int | float) else 0.0


def _arm_rates(profile: dict[str, Any]) -> dict[str, float]:
    """A cpu_speed profile's arms with their median output tok/s ({} for any other shape)."""
    return {
        arm: float(m["output_tok_s"])
        for arm, m in profile.items()
        if isinstance(m, dict) and isinstance(m.get("output_tok_s"), int | float)
    }


def baseline_chart(baseline: Baseline) -> bytes | None:
    """A chart for a baseline that has no recorded plot (None when nothing is plottable)."""
    data = baseline.data
    engines = _engine_metrics(data)
    if engines:
        labels = list(engines)
        return _bars(
            f"{baseline.name}: output tok/s",
            labels,
            {"output tok/s": [_pct(engines[e], "output_tok_s") for e in labels]},
            "tok/s",
        )
    median = data.get("median")  # arm -> median metrics (benchmark.dp_ab)
    if isinstance(median, dict) and median and all(isinstance(m, dict) for m in median.values()):
        labels = list(median)
        return _bars(
            f"{baseline.name}: output tok/s",
            labels,
            {"output tok/s": [_pct(median[a], "output_tok_s") for a in labels]},
            "tok/s",
        )
    results = data.get("results")
    if isinstance(results, list) and results and all(isinstance(r, dict) for r in results):
        labels = [f"{r.get('workload', '?')} ps{r.get('page_size', '?')}" for r in results]
        groups = {
            key: [float(r.get(key) or 0.0) for r in results]
            for key in ("ratio", "ratio_batch")
            if any(isinstance(r.get(key), int | float) for r in results)
        }
        if groups:
            return _bars(f"{baseline.name}: rust / python speedup", labels, groups, "x")
    if isinstance(results, dict) and all(isinstance(r, dict) for r in results.values()):
        steps = [k for k, r in results.items() if isinstance(r.get("step_ms"), dict)]
        if steps:  # benchmark.decode_step: each arm's median step against its memory floor
            return _bars(
                f"{baseline.name}: decode step",
                steps,
                {
                    "step ms (p50)": [_pct(results[k], "step_ms") for k in steps],
                    "memory floor ms": [float(results[k].get("floor_ms") or 0.0) for k in steps],
                },
                "ms",
            )
        profiles = {k: r for k, r in results.items() if _arm_rates(r)}
        if profiles:  # benchmark.cpu_speed: profile -> arm -> median output tok/s
            arms = sorted({a for r in profiles.values() for a in _arm_rates(r)})
            return _bars(
                f"{baseline.name}: output tok/s",
                list(profiles),
                {a: [_arm_rates(r).get(a, 0.0) for r in profiles.values()] for a in arms},
                "tok/s",
            )
        labels = [k for k, r in results.items() if isinstance(r.get("speedup"), int | float)]
        if labels:
            return _bars(
                f"{baseline.name}: typed / generic speedup",
                labels,
                {"speedup": [float(results[k]["speedup"]) for k in labels]},
                "x",
            )
    summary = data.get("summary")
    arms = {k: v for k, v in summary.items() if isinstance(v, dict) and "loaded_s" in v} if (
        isinstance(summary, dict)) else {}  # fmt: skip
    if arms:  # benchmark.contention: one request's latency alone and beside spinning processes
        return _pair_bars(f"{baseline.name}: one request's latency", arms,
                          ("quiet s", "quiet_s"), ("loaded s", "loaded_s"))  # fmt: skip
    runs = startup_runs(data)
    if runs:  # benchmark.startup (and an A/B of it): a fresh process, cold and warm
        return _pair_bars(f"{baseline.name}: LLM() start-up", runs,
                          ("process s", "process_s"), ("LLM() s", "llm_s"))  # fmt: skip
    workloads = data.get("workloads")
    if (
        isinstance(workloads, list)
        and workloads
        and all(
            isinstance(w, dict) and isinstance(w.get("off"), dict) and isinstance(w.get("on"), dict)
            for w in workloads
        )
    ):  # benchmark.speculative: each workload's tok/s with speculation off and on
        return _bars(
            f"{baseline.name}: output tok/s, speculation off / on",
            [str(w.get("workload", "?")) for w in workloads],
            {
                arm: [float(w[arm].get("output_tok_s") or 0.0) for w in workloads]
                for arm in ("off", "on")
            },
            "tok/s",
        )
    sets = parity_sets(data)
    if sets is not None:
        labels = list(sets)
        matched = [
            float(s.get("prompts", 0)) - float(s.get("mismatch_count", 0)) for s in sets.values()
        ]
        mismatched = [float(s.get("mismatch_count", 0)) for s in sets.values()]
        return _bars(
            f"{baseline.name}: token parity",
            labels,
            {"identical": matched, "mismatched": mismatched},
            "prompts",
        )
    return None


def startup_runs(data: dict) -> dict[str, dict]:
    """A start-up record's medians by run kind ("cold", "warm"; an A/B's "before cold", ...),
    or {} for another record."""
    summary = data.get("summary")
    if not isinstance(summary, dict):
        return {}
    if data.get("kind") == "startup":
        return {k: v for k, v in summary.items() if isinstance(v, dict)}
    if data.get("kind") == "startup_ab":
        return {
            f"{arm} {k}": v
            for arm, kinds in summary.items()
            if isinstance(kinds, dict)
            for k, v in kinds.items()
            if isinstance(v, dict)
        }
    return {}


def parity_sets(data: dict) -> dict[str, dict] | None:
    """A token-parity baseline's prompt sets (one dict each), or None: other baselines use
    `sets` for their `--set` overrides (strings)."""
    sets = data.get("sets")
    if isinstance(sets, dict) and sets and all(isinstance(s, dict) for s in sets.values()):
        return sets
    return None
