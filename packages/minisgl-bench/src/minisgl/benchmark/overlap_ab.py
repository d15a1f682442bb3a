"""Overlap scheduling vs the serial loop, offline, in one process and one run:

    python -m minisgl.benchmark.overlap_ab --profile seed-offline --repeats 3 \
        [--model-path DIR] [--sim-device 2,0.02] [--device-stream thread] --out X.json

Two `LLM`s on the same model and profile (`overlap=False`, and `overlap=True` on the given
device stream); after a warmup of each, the repeats alternate in ABBA order (`ab.py`; all
requests at t=0), so both arms see the same load drift. JSON: the median metrics of each arm, and
overlap / serial ratios (of the medians, and the median of the per-repeat ratios), with the
machine and its load average (a shared box is noisy: read the per-repeat ratios).
"""

from __future__ import annotations

import argparse
from typing import Any

from minisgl.benchmark import ab
from minisgl.benchmark.offline import make_llm
from minisgl.benchmark.profiles import PROFILES, get_profile
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
    fields = {
        "model": str(llm.config.model_path).rsplit("/", 1)[-1],
        "simulated_device": args.sim_device,
        "device_stream": llm.runtime.loop.stream.name,
        "device": str(llm.engine.device),
    }
    record, cmp, _ = ab.llm_ab("overlap-ab", argv, arms, profile, args.repeats, PAIRED)
    record |= fields | {
        "overlap_over_serial": cmp.ratio["overlap"],
        "overlap_over_serial_paired": cmp.paired["overlap"],
    }
    paired = record["overlap_over_serial_paired"]
    print(f"overlap / serial output tok/s (median of paired repeats): {paired['output_tok_s']:.3f}")
    ab.write(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
