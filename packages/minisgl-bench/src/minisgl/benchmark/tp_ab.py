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
from typing import Any

from minisgl.benchmark import ab
from minisgl.benchmark.offline import make_llm
from minisgl.benchmark.profiles import PROFILES, get_profile

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
    tp1, tpn = arms
    dtype = str(arms[tp1].engine.dtype).replace("torch.", "")
    comm = arms[tpn].engine.leader.comm
    record, cmp, outs = ab.llm_ab("tp-ab", argv, arms, profile, args.repeats, PAIRED,
                                  comm.reset_stats)  # fmt: skip
    steps, wall = sum(m["steps"] for m in cmp.runs[tpn]), record["wall_s"]
    record |= {
        "model": str(args.model_path).rstrip("/").rsplit("/", 1)[-1],
        "dtype": dtype,
        "threads": {tp1: threads, tpn: per_rank},
        "tp_over_tp1": cmp.ratio[tpn],
        "tp_over_tp1_paired": cmp.paired[tpn],
        "collectives_rank0": {
            "calls_per_step": comm.calls / max(1, steps),
            "ms_per_step": 1e3 * comm.seconds / max(1, steps),
            "share_of_wall": comm.seconds / wall if wall else None,
        },
        "greedy_agreement": _agreement(outs[tp1][0]["token_ids"], outs[tpn][0]["token_ids"]),
    }
    c = record["collectives_rank0"]
    print(f"{tpn} / tp1 output tok/s (paired median): "
          f"{record['tp_over_tp1_paired']['output_tok_s']:.3f}; rank 0 in collectives "
          f"{c['ms_per_step']:.2f} ms a step ({c['calls_per_step']:.0f} calls)")  # fmt: skip
    ab.write(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
