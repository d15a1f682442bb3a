"""One benchmark run's JSON record, shared by the harness's commands (`harness.py`,
`online_ab.py`): its common fields, the median over repeats, `--set` parsing, the model's
description, and the end of a run (gates, JSON, plot)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from minisgl.benchmark import common
from minisgl.benchmark.profiles import Profile, parse_sets
from minisgl.benchmark.report import plot

RATIO_KEYS = (
    "output_tok_s",
    "output_tok_per_cpu_s",
    "total_tok_s",
    "request_s",
    "ttft_ms.p50",
    "ttft_ms.p99",
    "tpot_ms.p50",
    "itl_ms.p50",
    "e2e_ms.p99",
    "sched_step_cpu_ms.p50",
    "sched_step_cpu_ms.p99",
)


def median_nested(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Key-wise median of numeric leaves across repeats (structure of the first run)."""
    if not runs:
        return {}
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = median_nested([r.get(key) or {} for r in runs])
        elif isinstance(value, int | float) and not isinstance(value, bool):
            vals = [r.get(key) for r in runs]
            out[key] = common.median(v for v in vals if isinstance(v, int | float))
        else:
            out[key] = value
    return out


def split_sets(items: list[str] | None) -> tuple[dict[str, str], dict[str, Any]]:
    sets = parse_sets(items)
    profile_sets = {k: v for k, v in sets.items() if not k.startswith("llm.")}
    llm_sets: dict[str, Any] = {}
    for key, value in sets.items():
        if key.startswith("llm."):
            llm_sets[key[4:]] = _literal(value)
    return profile_sets, llm_sets


def _literal(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(value.lower(), value)


def model_info(model_path: str | None) -> dict[str, Any]:
    if model_path is None:
        from minisgl.default_model import default_model_path

        model_path = str(default_model_path())
        name = "embedded:SmolLM2-135M-Instruct"
    else:
        name = Path(model_path).name
    info: dict[str, Any] = {"name": name, "path": Path(model_path).name}
    cfg_path = Path(model_path) / "config.json"
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        info.update(
            {
                "architecture": (cfg.get("architectures") or ["?"])[0],
                "hidden_size": cfg.get("hidden_size"),
                "num_layers": cfg.get("num_hidden_layers"),
                "vocab_size": cfg.get("vocab_size"),
            }
        )
    return info  # no absolute paths: results are committed (privacy guardrail)


def base_record(kind: str, args: argparse.Namespace, profile: Profile) -> dict[str, Any]:
    return {
        **common.record_header(kind),
        "backend_env": common.backend_env(),
        "profile": profile.to_dict(),
        "repeats": args.repeats,
    }


def finish(record: dict[str, Any], args: argparse.Namespace, plot_runs: dict[str, Any]) -> int:
    """Gates, JSON, plot; returns the exit status."""
    from minisgl.benchmark.gating import check_gates, gate_report, load_baseline_metrics

    status = 0
    if args.gate:
        baseline = load_baseline_metrics(args.baseline) if args.baseline else None
        ok, results, lines = check_gates(
            args.gate,
            record["gate_metrics"],
            record["machine"]["hardware"],
            baseline,
            allow_missing=args.allow_missing,
        )
        record["gates"] = {
            "files": args.gate,
            "baseline": args.baseline,
            "passed": ok,
            "results": gate_report(results),
        }
        print("\nGates:")
        for line in lines:
            print("  " + line)
        if not ok:
            failed = [ln for ln in lines if not ln.startswith("PASS")]
            print(f"GATE FAILED: {len(failed)} check(s) did not pass", file=sys.stderr)
            for line in failed:
                print("  " + line, file=sys.stderr)
            status = 1
    if args.plot and plot_runs:
        plot(args.plot, f"{record['kind']} {record['profile']['name']}", plot_runs)
        record["plot"] = args.plot
    if args.out:
        common.write_json(args.out, record)
        print(f"wrote {args.out}")
    return status
