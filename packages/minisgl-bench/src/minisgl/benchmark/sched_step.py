"""Scheduler step CPU at N running decode requests, no model (issue 39).

    python -m minisgl.benchmark.sched_step --out F.json [--running 256] [--repeats 3]

N requests with nano-vllm's prompt lengths (uniform 100-1024 tokens; page size 1, as the
simulated device's KV) are admitted and prefilled, then every step is timed with all N
decoding: `schedule` + `commit` (serial), and for the Python scheduler also `schedule_ahead` +
`commit_oldest` with one step in flight (the calls the overlap loop makes). Arms: `python` and,
where its extension imports, `rust_hotpath` (the Rust core in process: its decisions and one
crossing per call, without the service's IPC). Each repeat builds a fresh scheduler (arms in
ABBA order); the JSON has each repeat's p50 / p99 and their medians.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from minisgl.benchmark.backends import BackendUnavailable, check_cpu_backend
from minisgl.benchmark.common import (
    abba_order,
    git_commit,
    machine_info,
    median,
    now_iso,
    quantile,
    write_json,
)
from minisgl.core import SamplingParams
from minisgl.scheduler.backend import SchedulerBackend, SchedulerConfig


def running_scheduler(backend: str, running: int, seed: int) -> SchedulerBackend:
    """A scheduler of `backend` with `running` requests prefilled and decoding."""
    check_cpu_backend(backend)  # registers the in-process Rust arm
    from minisgl.scheduler.factory import make_scheduler

    cfg = SchedulerConfig(num_pages=running * 2048, page_size=1, max_seq_len=2048,
                          max_running_requests=running, max_extend_tokens=16384,
                          eos_token_ids=(0,))  # fmt: skip
    sched = make_scheduler(cfg, backend, shadow=False)
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=1024, ignore_eos=True)
    for _ in range(running):
        sched.add_request(rng.integers(100, 20000, size=int(rng.integers(100, 1025))), params)
    while True:
        planned = sched.schedule()
        assert planned is not None
        plan, reqs = planned
        sched.commit(reqs, plan, [1] * len(plan.sample_rows))
        if not plan.is_prefill:
            break
    if len(sched.running) != running:
        raise RuntimeError(f"{backend}: {len(sched.running)} of {running} requests running")
    return sched


def serial_steps(sched: Any, steps: int) -> list[float]:
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        plan, reqs = sched.schedule()
        sched.commit(reqs, plan, [100 + i % 64] * len(plan.sample_rows))
        times.append(time.perf_counter() - t0)
    return times


def pipelined_steps(sched: Any, steps: int) -> list[float]:
    times = []
    ahead = sched.schedule_ahead()
    for i in range(steps):
        t0 = time.perf_counter()
        nxt = sched.schedule_ahead()
        sched.commit_oldest([100 + i % 64] * len(ahead.plan.sample_rows))
        times.append(time.perf_counter() - t0)
        ahead = nxt
    return times


MODES: dict[str, Callable[[Any, int], list[float]]] = {
    "serial": serial_steps,
    "pipelined": pipelined_steps,
}


def run(arms: list[str], running: int, steps: int, repeats: int) -> dict[str, Any]:
    cases = [(b, m) for b in arms for m in MODES if m == "serial" or _pipelined(b)]
    per: dict[str, list[dict[str, float | None]]] = {f"{b}/{m}": [] for b, m in cases}
    for r in range(repeats):
        for backend, mode in abba_order(cases, r):
            sched = running_scheduler(backend, running, seed=r)
            ms = [t * 1e3 for t in MODES[mode](sched, steps)]
            per[f"{backend}/{mode}"].append({"p50": quantile(ms, 0.5), "p99": quantile(ms, 0.99)})
    return {
        name: {
            "p50_ms": median(x["p50"] for x in runs),
            "p99_ms": median(x["p99"] for x in runs),
            "repeats": runs,
        }
        for name, runs in per.items()
    }


def _pipelined(backend: str) -> bool:
    """The backend has the pipelined mode (`schedule_ahead` / `commit_oldest`)."""
    from minisgl.runtime.loop import pipelined
    from minisgl.scheduler.factory import make_scheduler

    cfg = SchedulerConfig(num_pages=8, page_size=1, max_seq_len=8, max_running_requests=1,
                          max_extend_tokens=8)  # fmt: skip
    return pipelined(make_scheduler(cfg, backend, shadow=False))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300, help="timed decode steps per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default="python,rust_hotpath")
    args = ap.parse_args(argv)
    arms = []
    for arm in args.arms.split(","):
        try:
            check_cpu_backend(arm)
            arms.append(arm)
        except BackendUnavailable as e:
            print(f"skipping {arm}: {e}")
    machine = machine_info()
    results = run(arms, args.running, args.steps, args.repeats)
    write_json(args.out, {
        "kind": "sched_step", "created": now_iso(), "git": git_commit(), "machine": machine,
        "running": args.running, "steps": args.steps, "repeats": args.repeats,
        "page_size": 1, "prompt_len": [100, 1024], "results": results,
    })  # fmt: skip
    for name, r in results.items():
        print(f"{name:<24} step CPU p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
