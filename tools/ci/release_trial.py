"""The release gate on real runs (issue 41): `--pairs` decisions between two runs of one build
(both sides against one server: they should promote) and as many against a build whose
requests take 20% longer end to end (a second server whose engine sleeps before every step,
`MINISGL_FAULT_STEP_DELAY_MS`, calibrated until the median e2e is within 4% of `--slowdown`
above the baseline's: they should hold).
Each side is one `harness online` run of `--repeats` repeats of `--profile` on the simulated
device; pair k's slow comparison reuses pair k's baseline. Writes a JSON summary.

    python tools/ci/release_trial.py --pairs 10 --out worklog/release/release-trial-cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

from minisgl.benchmark import common
from minisgl.default_model import default_model_path
from minisgl.testing.server import running_server

DECISIONS = {
    0: "promote",
    1: "hold",
    2: "rollback",
    3: "bad input",
    4: "mismatch",
    5: "insufficient",
}


def observe(base_url: str, args: argparse.Namespace, out: Path) -> dict:
    """One harness run against `base_url`: its observations at `out`, its metrics returned."""
    cmd = [sys.executable, "-m", "minisgl.benchmark.harness", "online", "--base-url", base_url,
           "--profile", args.profile, "--repeats", str(args.repeats), "--no-progress",
           "--observations", str(out), "--out", str(out.with_suffix(".json"))]  # fmt: skip
    for item in args.set or []:
        cmd += ["--set", item]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"harness failed ({done.returncode}): {done.stderr[-2000:]}")
    record = json.loads(out.with_suffix(".json").read_text())
    return next(iter(record["results"].values()))["metrics"]


def judge(baseline: Path, candidate: Path, policy: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "minisgl.benchmark.release_gate", "--baseline", str(baseline),
           "--candidate", str(candidate), "--policy", policy, "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    report = json.loads(out.read_text()) if out.exists() else {}
    return {"decision": DECISIONS.get(done.returncode, f"exit {done.returncode}"),
            "signals": report.get("signals", report.get("segments"))}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/ci/release_trial.py")
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", default="seed-online")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="profile override")
    p.add_argument("--sim-device", default="0.5,0.002")
    p.add_argument("--slowdown", type=float, default=0.2)
    p.add_argument("--policy", default="worklog/gates/release.cpu.yaml")
    p.add_argument("--out", required=True)
    p.add_argument("--keep", metavar="DIR", help="keep every run's observations in DIR")
    args = p.parse_args(argv)
    model = default_model_path()
    flags = ["--sim-device", args.sim_device, "--max-seq-len-override", "448"]
    rows: list[dict] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(args.keep or tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        with running_server(model, *flags, log_dir=tmp) as base:
            calib = observe(base.base_url, args, tmp / "calibration.jsonl")
            e2e = calib["e2e_ms"]["p50"]
            per_request = calib["output_tokens"] / calib["num_requests"]
            delay_ms = args.slowdown * e2e / per_request  # a first guess: every step slower
            calibration = []
            for attempt in range(4):
                stack = ExitStack()
                env = {"MINISGL_FAULT_STEP_DELAY_MS": f"{delay_ms:.4f}"}
                slow = stack.enter_context(running_server(model, *flags, log_dir=tmp, env=env))
                ratio = (
                    observe(slow.base_url, args, tmp / f"slow-{attempt}.jsonl")["e2e_ms"]["p50"]
                    / e2e
                )
                calibration.append(
                    {"step_delay_ms": round(delay_ms, 4), "e2e_p50_ratio": round(ratio, 4)}
                )
                if abs(ratio - 1 - args.slowdown) <= 0.04 or attempt == 3:
                    break
                stack.close()
                delay_ms *= args.slowdown / max(ratio - 1, 0.02)
            with stack:
                for k in range(args.pairs):
                    a, b, c = (tmp / f"{k}-{side}.jsonl" for side in ("base", "same", "slow"))
                    ma = observe(base.base_url, args, a)
                    mb = observe(base.base_url, args, b)
                    mc = observe(slow.base_url, args, c)
                    row = {"pair": k}
                    for name, cand, m in (("identical", b, mb), ("slower", c, mc)):
                        row[name] = judge(a, cand, args.policy, tmp / f"{k}-{name}.json")
                        row[name]["e2e_p95_ratio"] = round(
                            m["e2e_ms"]["p95"] / ma["e2e_ms"]["p95"], 4
                        )
                        row[name]["tpot_p50_ratio"] = round(
                            m["tpot_ms"]["p50"] / ma["tpot_ms"]["p50"], 4
                        )
                    rows.append(row)
                    print(f"pair {k}: identical {row['identical']['decision']} "
                          f"(e2e p95 {row['identical']['e2e_p95_ratio']}x), slower "
                          f"{row['slower']['decision']} (e2e p95 {row['slower']['e2e_p95_ratio']}x)",
                          flush=True)  # fmt: skip
    summary = {
        kind: dict(Counter(r[kind]["decision"] for r in rows)) for kind in ("identical", "slower")
    }
    record = {
        "schema_version": common.SCHEMA_VERSION,
        "tool": "release_trial",
        "argv": sys.argv[1:] if argv is None else argv,
        "git": common.git_commit(),
        "machine": common.machine_info(),
        "settings": {
            **vars(args),
            "step_delay_ms": round(delay_ms, 4),
            "baseline_e2e_p50_ms": round(e2e, 3),
        },
        "calibration": calibration,
        "wall_s": round(time.perf_counter() - t0, 1),
        "summary": summary,
        "pairs": rows,
    }
    common.write_json(args.out, record)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
