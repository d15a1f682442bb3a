"""Tensor parallelism: tp=1 against tp=N offline, in one run:

    python -m minisgl.benchmark.tp_ab --model-path worklog/models/Qwen2.5-0.5B-Instruct \
        --dummy-weights --dtype bfloat16 --profile seed-offline --tp 2 --repeats 3 --out X.json

Two `LLM`s on the same model and profile (tp=1 with the whole thread budget, tp=N with an
equal share per rank); after a warmup of each, the repeats alternate (ABBA), all requests at
t=0. JSON: each arm's median metrics, the tp=N / tp=1 ratios (of the medians and paired per
repeat), the greedy tokens' agreement between the arms, and rank 0's time in collectives per
step (gloo over loopback TCP, and the wait for the slower rank, on every all-reduce).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from minisgl.benchmark import common
from minisgl.benchmark.offline import make_llm, run_minisgl
from minisgl.benchmark.profiles import PROFILES, build_workload, get_profile, warmup_workload
from minisgl.benchmark.record import RATIO_KEYS, median_nested

PAIRED = ("output_tok_s", "e2e_ms.p50", "tpot_ms.p50")


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Requests with identical tokens, and the first index where each other one diverges."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    first = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
             for x, y in zip(a, b, strict=True) if x != y]  # fmt: skip
    return {"identical_requests": same, "requests": len(a), "first_divergence": first}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minisgl.benchmark.tp_ab")
    p.add_argument("--profile", default="seed-offline", choices=sorted(PROFILES))
    p.add_argument("--model-path", required=True, help="model dir (its heads split over --tp)")
    p.add_argument("--dummy-weights", action="store_true")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=None, help="override num_requests")
    p.add_argument("--threads", type=int, default=None, help="threads in all (default: cores)")
    p.add_argument("--out", help="result JSON path")
    args = p.parse_args(argv)
    profile = get_profile(args.profile, {"num_requests": args.requests} if args.requests else {})
    threads = args.threads or os.cpu_count() or 1
    kw: dict[str, Any] = {"dummy_weights": args.dummy_weights, "dtype": args.dtype,
                          "quantization": "none"}  # fmt: skip
    per_rank = max(1, threads // args.tp)
    arms = {
        "tp1": make_llm(args.model_path, profile, {**kw, "threads": threads}),
        f"tp{args.tp}": make_llm(
            args.model_path, profile, {**kw, "tp_size": args.tp, "threads": per_rank}
        ),
    }
    names = list(arms)
    vocab = arms["tp1"].engine.model_config.vocab_size
    items, warm = build_workload(profile, vocab), warmup_workload(profile, vocab)
    load0 = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    tokens: dict[str, list[list[int]]] = {}
    comm = arms[names[1]].engine.leader.comm
    try:
        for arm in arms.values():
            run_minisgl(arm, warm, honor_arrivals=False)
        comm.reset_stats()
        t0 = time.perf_counter()
        for r in range(args.repeats):
            for name in common.abba_order(names, r):
                res = run_minisgl(arms[name], items, honor_arrivals=False)
                runs[name].append(res["metrics"])
                tokens.setdefault(name, res["token_ids"])
        wall = time.perf_counter() - t0
        med = {n: median_nested(reps) for n, reps in runs.items()}
        steps = sum(m["steps"] for m in runs[names[1]])
        record = {
            **common.record_header("tp-ab", argv),
            "loadavg_before_after": [list(load0), list(os.getloadavg())],
            "wall_s": wall,
            "profile": profile.to_dict(),
            "model": str(args.model_path).rstrip("/").rsplit("/", 1)[-1],
            "dtype": str(arms["tp1"].engine.dtype).replace("torch.", ""),
            "threads": {"tp1": threads, names[1]: per_rank},
            "repeats": args.repeats,
            "results": {n: {"metrics": med[n], "repeats": runs[n]} for n in names},
            "tp_over_tp1": common.ratios(med["tp1"], med[names[1]], RATIO_KEYS),
            "tp_over_tp1_paired": common.paired_ratios(runs["tp1"], runs[names[1]], PAIRED),
            "collectives_rank0": {
                "calls_per_step": comm.calls / max(1, steps),
                "ms_per_step": 1e3 * comm.seconds / max(1, steps),
                "share_of_wall": comm.seconds / wall if wall else None,
            },
            "greedy_agreement": _agreement(tokens["tp1"], tokens[names[1]]),
        }
    finally:
        for arm in arms.values():
            arm.close()
    for n in names:
        m = med[n]
        print(f"{n:5s} {m['output_tok_s']:9.1f} out tok/s  e2e p50 {m['e2e_ms']['p50']:8.1f} ms"
              f"  tpot p50 {m['tpot_ms']['p50']:7.2f} ms  steps {m['steps']}")  # fmt: skip
    c = record["collectives_rank0"]
    print(f"{names[1]} / tp1 output tok/s (paired median): "
          f"{record['tp_over_tp1_paired']['output_tok_s']:.3f}; rank 0 in collectives "
          f"{c['ms_per_step']:.2f} ms a step ({c['calls_per_step']:.0f} calls)")  # fmt: skip
    if args.out:
        common.write_json(args.out, record)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
