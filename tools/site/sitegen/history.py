"""Headline metrics across commits, per machine class (CPU or a GPU name).

Two sources: every committed version of every baseline file (git history of
`worklog/baselines/*.json`) and every evidence run's gated metrics (value and threshold).
"""

from __future__ import annotations

from typing import Any

from sitegen.data import Baseline, HistoryPoint, Site, baseline_versions

# headline metrics per baseline kind: (label, key in the flat `gate_metrics` mapping)
HEADLINES: dict[str, tuple[str, ...]] = {
    "offline": (
        "output_tok_s",
        "speedup_vs_hf_paired.output_tok_s",
        "ttft_ms.p50",
        "sched_step_cpu_ms.p50",
    ),
    "online": ("output_tok_s", "ttft_ms.p50", "tpot_ms.p50"),
}


def workload(data: dict[str, Any]) -> str:
    """A short name of what a baseline measured: kind, model, profile, request count."""
    kind = str(data.get("kind") or data.get("benchmark") or "custom")
    model = data.get("model")
    if not isinstance(model, dict):
        return kind
    model_name = str(model.get("name", "?")).removeprefix("embedded:")
    profile = data.get("profile")
    if isinstance(profile, dict):
        n = profile.get("num_requests")
        return f"{kind} {model_name} {profile.get('name', '?')}" + (f" n={n}" if n else "")
    return f"{kind} {model_name}"


def _machine_class(data: dict[str, Any]) -> str:
    machine = data.get("machine")
    gpu = machine.get("gpu") if isinstance(machine, dict) else None
    if isinstance(gpu, dict):
        return str(gpu.get("name") or "gpu")
    return str(gpu) if gpu else "cpu"


def _headlines(data: dict[str, Any]) -> dict[str, float]:
    flat = data.get("gate_metrics")
    if not isinstance(flat, dict):
        return {}
    kind = str(data.get("kind", ""))
    keys = list(HEADLINES.get(kind, ()))
    if kind == "offline-ab":
        arms = [str(a) for a in data.get("arms", [])]
        for arm in arms:
            keys.append(f"ab.{arm}.output_tok_s")
        for arm in arms[1:]:
            keys.append(f"ab.{arm}.sched_step_cpu_ms.p50")
    out = {}
    for key in keys:
        value = flat.get(key)
        if isinstance(value, int | float):
            out[key] = float(value)
    if kind == "offline-ab":
        for arm, ratios in (data.get("ab_ratio_paired") or {}).items():
            value = ratios.get("output_tok_s") if isinstance(ratios, dict) else None
            if isinstance(value, int | float):
                out[f"ab_ratio_paired.{arm}.output_tok_s"] = float(value)
    return out


def baseline_points(site: Site, baseline: Baseline) -> list[HistoryPoint]:
    points: dict[tuple[str, str, str], HistoryPoint] = {}
    for sha, date, data in baseline_versions(site.root, baseline):
        git = data.get("git") if isinstance(data.get("git"), dict) else {}
        commit = str(git.get("commit") or sha or "working tree")
        utc = str(data.get("created") or date)
        for metric, value in _headlines(data).items():
            point = HistoryPoint(
                metric=metric,
                series=workload(data),
                machine_class=_machine_class(data),
                utc=utc,
                commit=commit,
                value=value,
                threshold=None,
                source=baseline.path,
            )
            points.setdefault((metric, commit, utc), point)
    return list(points.values())


def collect_history(site: Site) -> list[HistoryPoint]:
    points: list[HistoryPoint] = []
    for baseline in site.baselines:
        points.extend(baseline_points(site, baseline))
    for run in site.runs():
        for gate in run.gates:
            if not isinstance(gate.value, int | float):
                continue
            points.append(
                HistoryPoint(
                    metric=gate.metric,
                    series=run.card_id,
                    machine_class=run.machine_class,
                    utc=run.utc,
                    commit=run.commit,
                    value=float(gate.value),
                    threshold=float(gate.threshold)
                    if isinstance(gate.threshold, int | float)
                    else None,
                    source=run.path,
                )
            )
    return sorted(points, key=lambda p: (p.metric, p.machine_class, p.utc, p.series))


def chart_groups(points: list[HistoryPoint]) -> dict[tuple[str, str], list[HistoryPoint]]:
    """(metric, machine class) -> its points: one chart each."""
    groups: dict[tuple[str, str], list[HistoryPoint]] = {}
    for point in points:
        groups.setdefault((point.metric, point.machine_class), []).append(point)
    return groups
