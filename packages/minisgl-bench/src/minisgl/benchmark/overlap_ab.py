"""Overlap scheduling vs the serial loop, offline, in one process and one run:

    python -m minisgl.benchmark.overlap_ab --profile seed-offline --repeats 3 \
        [--model-path DIR] [--sim-device 2,0.02] [--device-stream thread] --out X.json

Two `LLM`s on the same model and profile (`overlap=False`, and `overlap=True` on the given
device stream); after a warmup of each, the repeats alternate serial / overlap (all requests
at t=0), so both arms see the same load drift. JSON: the median metrics of each arm, and
overlap / serial ratios (of the medians, and the median of the per-repeat ratios), with the
machine and its load average (a shared box is noisy: read the per-repeat ratios).
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
from minisgl.utils.threads import set_threads

PAIRED = ("output_tok_s", "output_tok_per_cpu_s", "e2e_ms.p50", "tpot_ms.p50")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minisgl.benchmark.overlap_ab")
    p.add_argument("--profile", default="seed-offline", choices=sorted(PROFILES))
    p.add_argument("--model-path", default=None, help="model dir (default: embedded)")
    p.add_argument("--sim-device", default=None, help="BASE_MS,TOKEN_MS (engine/sim.py)")
    p.add_argument("--device-stream", default=None, help="engine.stream.make_stream spec")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=None, help="override num_requests")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--out", help="result JSON path")
    args = p.parse_args(argv)
    if args.threads:
        set_threads(args.threads)
    profile = get_profile(args.profile, {"num_requests": args.requests} if args.requests else {})
    kw: dict[str, Any] = {"sim_device": args.sim_device} if args.sim_device else {}
    arms = {
        "serial": make_llm(args.model_path, profile, {**kw, "overlap": False}),
        "overlap": make_llm(
            args.model_path, profile, {**kw, "overlap": True, "device_stream": args.device_stream}
        ),
    }
    llm = arms["overlap"]
    assert llm.runtime.depth == 1, "overlap scheduling did not start"
    vocab = llm.engine.model_config.vocab_size
    items, warm = build_workload(profile, vocab), warmup_workload(profile, vocab)
    load0 = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for arm in arms.values():
        run_minisgl(arm, warm, honor_arrivals=False)
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        for name, arm in arms.items():
            runs[name].append(run_minisgl(arm, items, honor_arrivals=False)["metrics"])
    med = {name: median_nested(reps) for name, reps in runs.items()}
    record = {
        **common.record_header("overlap-ab", argv),
        "loadavg_before_after": [list(load0), list(os.getloadavg())],
        "wall_s": time.perf_counter() - t0,
        "profile": profile.to_dict(),
        "model": str(llm.config.model_path).rsplit("/", 1)[-1],
        "simulated_device": args.sim_device,
        "device_stream": llm.runtime.loop.stream.name,
        "device": str(llm.engine.device),
        "repeats": args.repeats,
        "results": {name: {"metrics": med[name], "repeats": runs[name]} for name in arms},
        "overlap_over_serial": common.ratios(med["serial"], med["overlap"], RATIO_KEYS),
        "overlap_over_serial_paired": common.paired_ratios(runs["serial"], runs["overlap"], PAIRED),
    }
    for name in arms:
        m = med[name]
        print(
            f"{name:8s} {m['output_tok_s']:9.1f} out tok/s  e2e p50 {m['e2e_ms']['p50']:8.1f} ms"
            f"  tpot p50 {m['tpot_ms']['p50']:7.2f} ms  steps {m['steps']}"
        )
    paired = record["overlap_over_serial_paired"]
    print(f"overlap / serial output tok/s (median of paired repeats): {paired['output_tok_s']:.3f}")
    for arm in arms.values():
        arm.close()
    if args.out:
        common.write_json(args.out, record)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
