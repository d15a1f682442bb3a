"""Gates for benchmark results: a thin adapter over `cardgate.thresholds` (one format, one evaluator).

Benchmark JSON carries `gate_metrics`, a flat {name: number} mapping; names are the dotted paths
of the metrics (`output_tok_s`, `ttft_ms.p99`, `hf.output_tok_s`, `speedup_vs_hf.output_tok_s`,
`ab.rust_hotpath.output_tok_s`, `ab_ratio.output_tok_s`...). Relative rules compare with another
metric of the same run (`relative.baseline: hf.output_tok_s` or an A/B arm) or, via
`--baseline OLD.json`, with the same metric of a recorded run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cardgate.thresholds import GateResult, evaluate, load_gates, summarize


def load_baseline_metrics(path: str | Path) -> dict[str, float]:
    data = json.loads(Path(path).read_text())
    metrics = data.get("gate_metrics")
    if not isinstance(metrics, dict):
        raise ValueError(f"{path}: no 'gate_metrics' mapping (not a harness result JSON?)")
    return {k: float(v) for k, v in metrics.items()}


def check_gates(
    gate_paths: list[str],
    metrics: dict[str, float],
    hardware: str,
    baseline: dict[str, float] | None = None,
    allow_missing: bool = False,
) -> tuple[bool, list[GateResult], list[str]]:
    """Evaluate; returns (ok, results, human lines). Missing metrics fail unless allowed."""
    gates = load_gates(*gate_paths)
    results = evaluate(gates, metrics, hardware, baseline)
    lines = []
    for r in results:
        if r.status == "n/a":
            continue
        tag = {"pass": "PASS", "fail": "FAIL", "missing": "MISSING"}[r.status]
        extra = ""
        if r.status == "fail" and r.margin is not None:
            pct = f" ({abs(r.margin_pct):.1f}%)" if r.margin_pct is not None else ""
            extra = f" -> {r.check} threshold missed by {abs(r.margin):.6g}{pct}"
        lines.append(f"{tag} [{r.check}] {r.message}{extra}  ({r.source})")
    status = summarize(results)
    ok = status in ("pass", "n/a") or (status == "missing" and allow_missing)
    return ok, results, lines


def gate_report(results: list[GateResult]) -> list[dict[str, Any]]:
    return [r.to_dict() for r in results]
