"""Where a `cpu_speed` profile's time goes, step by step, for one config:

    python -m minisgl.benchmark.cpu_step_profile --profile seed-offline --config default \
        [--set num_requests=128] [--threads 2] [--repeats 2]

Times every engine forward of the profile's workload (offline: all requests at once, as
`cpu_speed` runs it) and prints, per kind of step (prefill / decode through the C step / decode
through the modules) and row count, the steps, their total and mean time, against the pass's
wall time. The last of `--repeats` passes is reported (the first warms the allocator).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import defaultdict
from typing import Any


def _timed_forward(engine: Any, log: list[tuple[str, int, float]]) -> None:
    """Wrap `engine._forward` to append (kind, rows, seconds) per step."""
    inner = engine._forward

    def forward(plan: Any, staged: Any) -> Any:
        cpu = engine.cpu_decode
        steps = cpu.steps if cpu is not None else 0
        t0 = time.perf_counter()
        out = inner(plan, staged)
        dt = time.perf_counter() - t0
        kind = "prefill" if plan.is_prefill else "decode-modules"
        if cpu is not None and cpu.steps != steps:
            kind = "decode-c"
        log.append((kind, int(plan.num_tokens), dt))
        return out

    engine._forward = forward


def main(argv: list[str] | None = None) -> int:
    from minisgl.benchmark.cpu_speed import llm_options, set_threads
    from minisgl.benchmark.offline import make_llm, run_minisgl
    from minisgl.benchmark.profiles import build_workload, get_profile, parse_sets

    p = argparse.ArgumentParser(prog="python -m minisgl.benchmark.cpu_step_profile")
    p.add_argument("--profile", default="seed-offline")
    p.add_argument("--config", default="default")
    p.add_argument("--set", action="append", metavar="KEY=VALUE")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    set_threads(args.threads)
    prof = get_profile(args.profile, parse_sets(args.set))
    llm = make_llm(None, prof, {**llm_options(args.config), "max_seq_len_override": 2048})
    items = [dataclasses.replace(i, arrival_s=0.0) for i in build_workload(prof, 49152)]
    log: list[tuple[str, int, float]] = []
    _timed_forward(llm.engine, log)
    for _ in range(args.repeats):
        log.clear()
        t0 = time.perf_counter()
        metrics = run_minisgl(llm, items, honor_arrivals=False)["metrics"]
        wall = time.perf_counter() - t0
    by: dict[tuple[str, int], list[float]] = defaultdict(list)
    for kind, rows, dt in log:
        by[(kind, rows)].append(dt)
    print(f"{prof.name} {args.config}: {metrics['output_tok_s']:.1f} tok/s, wall {wall:.2f} s, "
          f"forwards {sum(dt for *_, dt in log):.2f} s")  # fmt: skip
    totals: dict[str, float] = defaultdict(float)
    for (kind, rows), dts in sorted(by.items()):
        totals[kind] += sum(dts)
        print(f"  {kind:15s} rows {rows:5d}: {len(dts):4d} steps, {sum(dts):7.3f} s, "
              f"{1e3 * sum(dts) / len(dts):8.2f} ms a step")  # fmt: skip
    for kind, s in sorted(totals.items()):
        print(f"  {kind:15s} total {s:7.3f} s ({100 * s / wall:.0f}% of wall)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
