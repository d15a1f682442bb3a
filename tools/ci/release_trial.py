"""The release gate on real runs (issue 41): `--pairs` decisions between two runs of one build
(both sides against one server: they should promote) and as many against a build whose
requests take 20% longer end to end (a second server whose engine spins on the CPU before every
step, `MINISGL_FAULT_STEP_CPU_MS`, or sleeps, `MINISGL_FAULT_STEP_DELAY_MS` with `--fault sleep`,
calibrated until the median e2e is within 4% of `--slowdown` above the baseline's: they should
hold).

Each decision has `--repeats` runs a side of `--profile` on the simulated device, interleaved
the way the harness's `--ab` runs are: in repeat r the three sides (baseline, slower,
identical) run one after another, in ABBA order across repeats, all through one benchmark client
process (`benchmark/client.py`), so repeat r of every side sees the same machine (the gate
pairs runs by repeat: `release_stats.py`). The calibration interleaves the same way.
`--sequential` runs each side's repeats back to back instead (what the first trial did, one
harness process a side). Writes a JSON summary; `--keep DIR` keeps every observation file.

    python tools/ci/release_trial.py --pairs 10 --repeats 16 --set num_requests=16 \
        --out worklog/release/release-trial-cpu-seed-online-16x16.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from minisgl.benchmark import common, observe, release_gate
from minisgl.benchmark.client import ClientJob, ClientProcess
from minisgl.benchmark.observations import Observation, write_jsonl
from minisgl.benchmark.online import PreparedRun, prepare, server_backend, stream_observations
from minisgl.benchmark.profiles import Profile, get_profile, parse_sets
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
# run order in a repeat (ABBA across repeats): the two runs of the baseline's server never
# follow each other within a repeat (a run right after another on the same server was slower:
# identical builds at 1.09-1.14x with base, same, slow)
SIDES = ("base", "slow", "same")
FAULTS = {"cpu": "MINISGL_FAULT_STEP_CPU_MS", "sleep": "MINISGL_FAULT_STEP_DELAY_MS"}


class Runner:
    """Runs of the profile against the servers, through one client process."""

    def __init__(self, args: argparse.Namespace, profile: Profile, client: ClientProcess):
        self.args, self.profile, self.client = args, profile, client
        self.preps: dict[str, tuple[argparse.Namespace, PreparedRun, str]] = {}
        self.device = observe.device_label(True)

    def run(self, url: str, repeat: int) -> list[Observation]:
        if url not in self.preps:
            ns = argparse.Namespace(base_url=url, api_key="EMPTY", timeout=600.0, model=None,
                                    model_path=str(default_model_path()), server_pid=None,
                                    observations=None, no_progress=True)  # fmt: skip
            self.preps[url] = (ns, prepare(ns, self.profile), server_backend(url))
        ns, prep, backend = self.preps[url]
        out = self.client.run(ClientJob(ns, self.profile, prep))
        labels = observe.RunLabels(self.profile.name, backend, self.device,
                                   Path(out["model"]).name, "minisgl-online", repeat)  # fmt: skip
        return stream_observations(out, labels)


def schedule(repeats: int, sides: tuple[str, ...], sequential: bool) -> list[tuple[str, int]]:
    """(side, repeat) in run order: ABBA across repeats, or each side's repeats in a row."""
    if sequential:
        return [(s, r) for s in sides for r in range(repeats)]
    return [(s, r) for r in range(repeats) for s in common.abba_order(sides, r)]


def e2e_median_ratio(base: list[Observation], cand: list[Observation]) -> float:
    """Geometric mean over repeats of the runs' median e2e ratios (the gate's pairing)."""
    ratios = []
    for r in sorted({o.repeat for o in base}):
        b = statistics.median(o.e2e_s for o in base if o.repeat == r and o.e2e_s is not None)
        c = statistics.median(o.e2e_s for o in cand if o.repeat == r and o.e2e_s is not None)
        ratios.append(c / b)
    return statistics.geometric_mean(ratios)


def judge(baseline: Path, candidate: Path, policy: str, out: Path) -> dict[str, Any]:
    with contextlib.redirect_stdout(io.StringIO()):
        rc = release_gate.main(["--baseline", str(baseline), "--candidate", str(candidate),
                                "--policy", policy, "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text()) if out.exists() else {}
    latency = [
        {k: s[k] for k in ("name", "value", "ok", "on_fail", "detail")}
        for s in report.get("signals", [])
        if s.get("kind") == "latency" and s.get("ok") is not None
    ]
    return {"decision": DECISIONS.get(rc, f"exit {rc}"), "latency": latency}


def calibrate(
    args: argparse.Namespace,
    run: Callable[[str, int], list[Observation]],
    base_url: str,
    start_slow: Callable[[float], str],
    e2e_ms: float,
    per_request: float,
) -> tuple[float, list[dict[str, float]]]:
    """A step delay whose slowdown of the median e2e is within 4% of `--slowdown`: 4
    interleaved runs a side of the baseline and a slow server per delay tried, the next delay
    from a least-squares slope through every delay tried (slowdown ~ delay), within half to
    twice the last; after 4 tries the slow server runs at the fitted delay."""
    delay_ms = args.slowdown * e2e_ms / per_request  # a first guess: every step slower
    tried: list[dict[str, float]] = []
    for attempt in range(4):
        slow_url = start_slow(delay_ms)
        sides: dict[str, list[Observation]] = {"base": [], "slow": []}
        for side, r in schedule(4, ("base", "slow"), False):
            sides[side] += run(base_url if side == "base" else slow_url, r)
        ratio = e2e_median_ratio(sides["base"], sides["slow"])
        tried.append({"step_delay_ms": round(delay_ms, 4), "e2e_p50_ratio": round(ratio, 4)})
        print(f"calibration {attempt}: delay {delay_ms:.3f} ms -> e2e p50 {ratio:.3f}x",
              flush=True)  # fmt: skip
        if abs(ratio - 1 - args.slowdown) <= 0.04:
            return delay_ms, tried
        slope = sum(t["step_delay_ms"] * (t["e2e_p50_ratio"] - 1) for t in tried) / sum(
            t["step_delay_ms"] ** 2 for t in tried
        )
        fitted = args.slowdown / slope if slope > 0 else 2 * delay_ms
        delay_ms = min(max(fitted, delay_ms / 2), 2 * delay_ms)
    start_slow(delay_ms)
    tried.append({"step_delay_ms": round(delay_ms, 4), "fitted": 1.0})
    return delay_ms, tried


def _public(argv: list[str]) -> list[str]:
    """argv without --keep DIR (a local path)."""
    out, skip = [], False
    for a in argv:
        if skip or a == "--keep" or a.startswith("--keep="):
            skip = a == "--keep"
            continue
        out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/ci/release_trial.py")
    p.add_argument("--pairs", type=int, default=10)
    # 16 interleaved runs of 16 requests a side: the best of the real trials on the loaded
    # 2-core box (docs/release_gate.md); 3 runs cannot bound 20% at the gate's confidence
    p.add_argument("--repeats", type=int, default=16)
    p.add_argument("--profile", default="seed-online")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="profile override")
    p.add_argument("--sim-device", default="0.5,0.002")
    p.add_argument("--slowdown", type=float, default=0.2)
    p.add_argument("--step-delay-ms", type=float, help="skip the calibration: this delay")
    p.add_argument(
        "--fault",
        choices=sorted(FAULTS),
        default="cpu",
        help="the slower build: CPU time spun before every step (cpu, default: a real "
        "regression's cost, which a loaded machine does not hide) or a sleep (sleep)",
    )
    p.add_argument("--sequential", action="store_true", help="each side's repeats in a row")
    p.add_argument("--policy", default="worklog/gates/release.cpu.yaml")
    p.add_argument("--out", required=True)
    p.add_argument("--keep", metavar="DIR", help="keep every run's observations in DIR")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on a kill
    profile = get_profile(args.profile, parse_sets(args.set))
    model = default_model_path()
    flags = ["--sim-device", args.sim_device, "--max-seq-len-override", "448"]
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp_name, ClientProcess() as client, ExitStack() as st:
        tmp = Path(args.keep or tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        runner = Runner(args, profile, client)
        base = st.enter_context(running_server(model, *flags, log_dir=tmp))
        warm = runner.run(base.base_url, 0)  # the client's first run: slower, not counted
        e2e_ms = 1000 * statistics.median(o.e2e_s for o in warm if o.e2e_s is not None)
        per_request = statistics.fmean(o.output_tokens or 1 for o in warm)
        slow_stack = ExitStack()
        slow_urls: list[str] = []

        def start_slow(delay_ms: float) -> str:
            slow_stack.close()
            env = {FAULTS[args.fault]: f"{delay_ms:.4f}"}
            server = slow_stack.enter_context(running_server(model, *flags, log_dir=tmp, env=env))
            slow_urls.append(server.base_url)
            return server.base_url

        st.callback(slow_stack.close)
        if args.step_delay_ms is not None:
            delay_ms, calibration = args.step_delay_ms, []
            start_slow(delay_ms)
        else:
            delay_ms, calibration = calibrate(
                args, runner.run, base.base_url, start_slow, e2e_ms, per_request
            )
        urls = {"base": base.base_url, "same": base.base_url, "slow": slow_urls[-1]}
        achieved = []
        for k in range(args.pairs):
            obs: dict[str, list[Observation]] = {s: [] for s in SIDES}
            for side, r in schedule(args.repeats, SIDES, args.sequential):
                obs[side] += runner.run(urls[side], r)
            paths = {s: write_jsonl(tmp / f"{k}-{s}.jsonl", o) for s, o in obs.items()}
            row: dict[str, Any] = {"pair": k}
            for name, side in (("identical", "same"), ("slower", "slow")):
                row[name] = judge(paths["base"], paths[side], args.policy, tmp / f"{k}-{name}.json")
                row[name]["e2e_p50_ratio"] = round(e2e_median_ratio(obs["base"], obs[side]), 4)
            achieved.append(row["slower"]["e2e_p50_ratio"])
            rows.append(row)
            print(f"pair {k}: identical {row['identical']['decision']} (e2e p50 "
                  f"{row['identical']['e2e_p50_ratio']}x), slower {row['slower']['decision']} "
                  f"(e2e p50 {row['slower']['e2e_p50_ratio']}x)", flush=True)  # fmt: skip
    summary = {
        kind: dict(Counter(r[kind]["decision"] for r in rows)) for kind in ("identical", "slower")
    }
    record = {
        "schema_version": common.SCHEMA_VERSION,
        "tool": "release_trial",
        "argv": _public(sys.argv[1:] if argv is None else argv),
        "git": common.git_commit(),
        "machine": common.machine_info(),
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("keep",)},
            "order": "sequential" if args.sequential else "abba",
            "step_delay_ms": round(delay_ms, 4),
            "warmup_e2e_p50_ms": round(e2e_ms, 3),
        },
        "calibration": calibration,
        "slower_e2e_p50_ratio": {
            "median": round(statistics.median(achieved), 4) if achieved else None,
            "min": min(achieved, default=None),
            "max": max(achieved, default=None),
        },
        "wall_s": round(time.perf_counter() - t0, 1),
        "summary": summary,
        "pairs": rows,
    }
    common.write_json(args.out, record)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
