"""dp=1 vs dp=N on one profile: a server per arm and repeat (ABBA order), the online benchmark
against it, the prefix hit rate and the per-replica split from its /metrics.

    python -m minisgl.benchmark.dp_ab --profile shared-prefix --dp 2 --repeats 3 \
        [--backend rust_service] [--threads-total 2] [--set key=value] --out F.json

Arm `dp1`: `--dp 1 --threads T` (or `--baseline-threads`); arm `dpN`: `--dp N --threads T/N`
(each replica its share of the same T cores). With `--sim-device BASE_MS,TOKEN_MS` no model
runs: each replica steps a simulated device of its own (as each would own a GPU) and no thread
budget is split; what is left on the host's cores is the control plane. The hit rate counts
the benchmark's warm-up requests too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from minisgl.benchmark import ab, common
from minisgl.benchmark.online_ab import server_flags
from minisgl.benchmark.profiles import get_profile
from minisgl.testing.server import metric, metrics, running_server

KEYS = ("output_tok_s", "request_s")


def run_arm(model: str | None, flags: list[str], backend: str, bench: list[str], tmp: Path):
    """One server, one online run: (benchmark metrics, /metrics numbers)."""
    from minisgl.default_model import default_model_path

    model = model or str(default_model_path())
    env = {"MINISGL_CPU_BACKEND": backend}
    with running_server(model, *flags, log_dir=tmp, env=env) as server:
        out = tmp / "run.json"
        cmd = [sys.executable, "-m", "minisgl.benchmark.harness", "online", "--base-url",
               server.base_url, "--no-progress", "--out", str(out), *bench]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())["gate_metrics"]
        text = metrics(server)
    dp = sum(1 for line in text.splitlines() if line.startswith("minisgl_replica_healthy{"))
    prompt = metric(text, "minisgl_prompt_tokens_total")
    observed = {
        "prefix_hit_rate": metric(text, "minisgl_cached_prompt_tokens_total") / max(prompt, 1),
        "routed": [
            metric(text, "minisgl_replica_requests_routed_total", f'{{replica="{i}"}}')
            for i in range(dp)
        ],
        "replica_hit_rate": [
            metric(text, "minisgl_replica_prefix_cache_hit_rate", f'{{replica="{i}"}}')
            for i in range(dp)
        ],
    }
    return {k: result[k] for k in KEYS}, observed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minisgl.benchmark.dp_ab")
    p.add_argument("--profile", default="shared-prefix")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", default="rust_service")
    p.add_argument("--threads-total", type=int, default=2)
    p.add_argument("--baseline-threads", type=int, default=None, help="dp1's (default: all)")
    p.add_argument("--model-path", default=None)
    p.add_argument("--sim-device", default=None, metavar="BASE_MS,TOKEN_MS",
                   help="no model: a simulated device per replica (engine/sim.py)")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--note", action="append", default=[])
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    sets = dict(s.split("=", 1) for s in args.set)
    profile = get_profile(args.profile, sets)
    bench = ["--profile", args.profile, *(f"--set={s}" for s in args.set)]
    arms = {"dp1": ["--dp", "1"], f"dp{args.dp}": ["--dp", str(args.dp)]}
    if args.sim_device is None:  # a model on the CPU: the replicas share the cores
        per = max(1, args.threads_total // args.dp)
        arms["dp1"] += ["--threads", str(args.baseline_threads or args.threads_total)]
        arms[f"dp{args.dp}"] += ["--threads", str(per)]
    with tempfile.TemporaryDirectory(prefix="dp-ab-") as tmp:

        def one(name: str, _: int) -> dict[str, Any]:
            flags = server_flags(profile, args.sim_device, arms[name])
            bench_m, observed = run_arm(args.model_path, flags, args.backend, bench, Path(tmp))
            return {**bench_m, **observed}

        runs = ab.interleave(list(arms), args.repeats, one)
    summary = ab.compare(runs, KEYS, median=ab.key_medians((*KEYS, "prefix_hit_rate"))).medians
    a, b = arms
    doc = {
        **common.record_header("dp_ab", argv),
        "profile": args.profile,
        "sets": sets,
        "backend": args.backend,
        "threads_total": None if args.sim_device else args.threads_total,
        "sim_device": args.sim_device,
        "arms": {name: " ".join(flags) for name, flags in arms.items()},
        "median": summary,
        "speedup_output_tok_s": summary[b]["output_tok_s"] / summary[a]["output_tok_s"],
        "hit_rate_ratio": summary[b]["prefix_hit_rate"] / max(summary[a]["prefix_hit_rate"], 1e-9),
        "repeats": runs,
        "notes": args.note,
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc[k] for k in ("median", "speedup_output_tok_s", "hit_rate_ratio")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
