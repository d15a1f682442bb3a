"""One decode step, timed and its kernels counted, per arm (the fused Triton decode layer, the
torch ops), in one run:

    python -m minisgl.benchmark.decode_step --model-path worklog/models/Qwen2.5-0.5B-Instruct \
        --dummy-weights --dtype bfloat16 --batch 64 --context 512 --out X.json

Each arm builds its own `Engine` (the arms differ only by `MINISGL_FUSED_OPS`), prefills `batch` random prompts of `context` tokens, then times
`sample_step` of the next decode step (stage + graph replay or eager forward + greedy + the
token copy): median and p95 of `--repeats` after `--warmup`. Kernels of one eager forward:
torch.profiler's CUDA kernels on a GPU (copies and memsets left out), the dispatch-mode +
Triton-launch counter on a CPU (`minisgl.testing.launches`). The bound: the bytes one step
must read (weights once, the batch's KV), over the memory bandwidth (`--bandwidth-gb-s`,
default by GPU name), against the measured step. With `--profile-steps N` (CUDA): the GPU
time of N steps by kernel, graph replays included (busy time a step, the top kernels).

(No inductor arm: the engine's decode graphs capture the eager model, so `enable_torch_compile`
with graphs would time the torch ops again.)
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from minisgl.benchmark import common

# HBM bandwidth by GPU name (vendor figures), for the step's memory floor
BANDWIDTH_GB_S = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}
ARMS = ("fused", "torch")


@dataclass(frozen=True)
class Arm:
    name: str
    fused_ops: str  # MINISGL_FUSED_OPS


ARM_SETTINGS = {"fused": Arm("fused", "auto"), "torch": Arm("torch", "off")}


def _engine(args: argparse.Namespace, arm: Arm, runner: str):
    from minisgl.config import EngineConfig
    from minisgl.engine.engine import Engine

    os.environ["MINISGL_FUSED_OPS"] = arm.fused_ops
    per_request = args.context + args.warmup + args.repeats + 8
    cfg = EngineConfig(
        model_path=args.model_path, device=args.device, dtype=args.dtype,
        dummy_weights=args.dummy_weights, attention_backend=args.attention_backend,
        graph_runner=runner, cuda_graph_max_bs=args.batch, max_running_requests=args.batch,
        max_seq_len_override=per_request,
        num_pages=args.batch * per_request + 64,
    )  # fmt: skip
    return Engine(cfg), per_request


def _kernels(engine, plan) -> dict[str, Any]:
    """Kernels of one eager forward of `plan`."""
    import torch

    if engine.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.forward(plan)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA
                 and not e.name.startswith(("Memcpy", "Memset"))]  # fmt: skip
        return {"source": "torch.profiler CUDA kernels", "total": len(names)}
    from minisgl.testing.launches import count_launches

    with count_launches() as counter:
        engine.forward(plan)
    return {"source": "dispatch-mode + Triton launch counter", "total": counter.total}


def _kernel_time(engine, batch, plan, steps: int, top: int) -> dict[str, Any]:
    """GPU time of `steps` timed steps by kernel (torch.profiler, graph replays included): busy
    time a step and the `top` kernels by time, each with its launches and time a step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from minisgl.testing.plans import GreedyRow

    rows = [GreedyRow()] * len(batch.ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.sample_step(plan, rows, frozenset())
        torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    spans: list[tuple[float, float]] = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = per.setdefault(e.name[:160], [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.elapsed_us()
            spans.append((e.time_range.start, e.time_range.end))
    ranked = sorted(per.items(), key=lambda kv: -kv[1][1])
    idle = _idle_us(spans)
    return {
        "steps": steps,
        "busy_us_a_step": round(sum(v[1] for v in per.values()) / steps, 1),
        "kernels_a_step": round(sum(v[0] for v in per.values()) / steps, 1),
        # the GPU idle between consecutive kernels: short gaps are launch latency inside a
        # replay, long ones the host (staging, result, the next step's start)
        "gap_us_a_step": round(idle[0] / steps, 1),
        "host_gap_us_a_step": round(idle[1] / steps, 1),
        "top": [{"name": name, "launches_a_step": round(n / steps, 2),
                 "us_a_step": round(us / steps, 2)} for name, (n, us) in ranked[:top]],
    }  # fmt: skip


def _idle_us(spans: list[tuple[float, float]], long_us: float = 20.0) -> tuple[float, float]:
    """(idle time in gaps shorter than `long_us`, idle time in longer gaps) between kernels,
    µs, from their (start, end) times."""
    short = long = 0.0
    end = None
    for start, stop in sorted(spans):
        if end is not None and start > end:
            gap = start - end
            if gap < long_us:
                short += gap
            else:
                long += gap
        end = stop if end is None else max(end, stop)
    return short, long


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_steps(engine, batch, plan, count: int) -> list[float]:
    from minisgl.testing.plans import GreedyRow

    rows = [GreedyRow()] * len(batch.ids)
    times = []
    for _ in range(count):
        _sync(engine.device)
        t0 = time.perf_counter()
        engine.sample_step(plan, rows, frozenset())
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _bytes_a_step(engine, batch: int, context: int) -> dict[str, int]:
    """Weights read once plus the KV of `batch` requests of `context` tokens (K and V)."""
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv = sum(t[:1].numel() * t.element_size() for t in (*engine.pool.k, *engine.pool.v))
    return {"weights": weights, "kv": kv * batch * context}


def run_arm(args: argparse.Namespace, arm: Arm) -> dict[str, Any]:
    from minisgl.testing.plans import GreedyRow, PlannedBatch

    runner = "cuda" if args.device == "cuda" else "none"
    t0 = time.perf_counter()
    engine, per_request = _engine(args, arm, runner)
    batch = PlannedBatch.for_engine(engine, [args.context] * args.batch, per_request)
    rows = [GreedyRow()] * args.batch
    batch.push(engine.sample_step(batch.plan(True), rows, frozenset()).tokens)
    plan = batch.plan(False)
    _time_steps(engine, batch, plan, args.warmup)
    start_s = time.perf_counter() - t0
    step = _time_steps(engine, batch, plan, args.repeats)
    layers = engine.model_config.num_layers
    kernels = _kernels(engine, plan)
    kernels["per_layer_incl_fixed"] = round(kernels["total"] / layers, 2)
    moved = _bytes_a_step(engine, args.batch, args.context)
    profiled = (
        _kernel_time(engine, batch, plan, args.profile_steps, args.profile_top)
        if engine.device.type == "cuda" and args.profile_steps
        else None
    )
    splits = getattr(engine.backend, "num_kv_splits", None)
    out = {
        "fused_ops": engine.model.fused_ops is not None,
        "kv_splits": splits(args.batch) if splits is not None else None,
        "graphs": engine.graphs is not None and engine.graphs.can_run(plan),
        "start_s": round(start_s, 2),
        "step_ms": common.percentiles(step),
        "kernels": kernels,
        "kernel_time": profiled,
        "bytes": moved,
    }
    del engine
    gc.collect()
    if args.device == "cuda":
        import torch

        torch.cuda.empty_cache()
    return out


@dataclass(frozen=True)
class Tuning:
    """The triton backend's decode knobs for one run (None: the backend's own)."""

    programs_per_sm: int | None = None
    tile: tuple[int, int] | None = None  # the split kernel's (BLOCK_N, num_warps)

    @property
    def suffix(self) -> str:
        pps = f"@pps{self.programs_per_sm}" if self.programs_per_sm is not None else ""
        tile = f"@n{self.tile[0]}w{self.tile[1]}" if self.tile is not None else ""
        return pps + tile


def _tuned(tuning: Tuning, fn, *args):
    """`fn(*args)` with the triton backend's decode knobs set as `tuning` says."""
    from minisgl.attention import triton_backend

    old = triton_backend._PROGRAMS_PER_SM, triton_backend._DECODE_TILE
    if tuning.programs_per_sm is not None:
        triton_backend._PROGRAMS_PER_SM = tuning.programs_per_sm
    if tuning.tile is not None:
        triton_backend._DECODE_TILE = tuning.tile
    try:
        return fn(*args)
    finally:
        triton_backend._PROGRAMS_PER_SM, triton_backend._DECODE_TILE = old


def _tile(text: str) -> tuple[int, int]:
    n, _, w = text.strip().partition("x")
    return int(n), int(w or 4)


def _bandwidth(args: argparse.Namespace, machine: dict[str, Any]) -> float | None:
    if args.bandwidth_gb_s:
        return args.bandwidth_gb_s
    name = ((machine.get("gpu") or {}).get("name") or "").upper()
    return next((bw for key, bw in BANDWIDTH_GB_S.items() if key in name), None)


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m minisgl.benchmark.decode_step`."""
    p = argparse.ArgumentParser(prog="python -m minisgl.benchmark.decode_step")
    p.add_argument("--model-path", required=True)
    p.add_argument("--dummy-weights", action="store_true")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--arms", default="fused,torch", help=f"comma list of {', '.join(ARMS)}")
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="on CUDA: steps to profile by kernel (GPU time a step, top kernels)",
    )
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument(
        "--kv-programs-per-sm",
        default="",
        help="comma list: sweep the triton backend's split-KV target (decode "
        "programs per SM; default: the backend's own)",
    )
    p.add_argument(
        "--decode-tiles",
        default="",
        help="comma list of BLOCK_NxWARPS (e.g. 64x4,128x8): sweep the triton decode split "
        "kernel's tile (default: the backend's own)",
    )
    p.add_argument("--bandwidth-gb-s", type=float, default=None,
                   help="memory bandwidth for the floor (default: by GPU name)")  # fmt: skip
    p.add_argument("--out", help="result JSON path")
    return p


def _tunings(args: argparse.Namespace) -> list[Tuning]:
    """Every combination of the swept triton knobs (`--kv-programs-per-sm`, `--decode-tiles`);
    one `Tuning()` (the backend's own) without a sweep."""
    pps: list[int | None] = [int(x) for x in args.kv_programs_per_sm.split(",") if x.strip()]
    tiles: list[tuple[int, int] | None] = [
        _tile(x) for x in args.decode_tiles.split(",") if x.strip()
    ]
    return [Tuning(n, t) for n in pps or [None] for t in tiles or [None]]


def _measure(
    args: argparse.Namespace, arm: str, tuning: Tuning, bandwidth: float | None
) -> dict[str, Any]:
    """One arm's result under `tuning` (`run_arm`), with its memory floor when the bandwidth
    is known; `{"error": ...}` when the arm cannot run."""
    try:
        res = _tuned(tuning, run_arm, args, ARM_SETTINGS[arm])
    except Exception as e:  # an arm that cannot run is recorded, the others still run
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    if "step_ms" in res and bandwidth:
        floor_ms = sum(res["bytes"].values()) / (bandwidth * 1e9) * 1e3
        res["floor_ms"] = float(f"{floor_ms:.4g}")
        res["fraction_of_floor"] = float(f"{floor_ms / res['step_ms']['p50']:.4g}")
    return res


def _ratios(results: dict[str, Any]) -> dict[str, float]:
    """`<run>_vs_torch_step`: the torch arm's median step over each other run's."""
    base = results.get("torch", {}).get("step_ms", {}).get("p50")
    return {
        f"{name}_vs_torch_step": round(base / res["step_ms"]["p50"], 3)
        for name, res in results.items()
        if name != "torch" and base and "step_ms" in res
    }


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        p.error(f"unknown arms {unknown}: choose from {', '.join(ARMS)}")
    machine = common.machine_info()
    bandwidth = _bandwidth(args, machine)
    runs = [(a, t, a + t.suffix) for a in arms for t in _tunings(args)]
    results: dict[str, Any] = {}
    for arm, tuning, name in runs:
        results[name] = res = _measure(args, arm, tuning, bandwidth)
        print(f"{name}: {res.get('step_ms', {}).get('p50')} ms p50, "
              f"{res.get('kernels', {}).get('total')} kernels a step"
              + (f" [{res['error']}]" if "error" in res else ""), file=sys.stderr)  # fmt: skip
    ratios = _ratios(results)
    record = {
        "schema_version": common.SCHEMA_VERSION,
        "tool": "decode_step",
        "argv": sys.argv[1:] if argv is None else argv,
        "git": common.git_commit(),
        "machine": machine,
        "env": common.backend_env(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "bandwidth_gb_s": bandwidth,
        "results": results,
        "ratios": ratios,
    }
    if args.out:
        common.write_json(args.out, record)
    print(common.json.dumps({"results": results, "ratios": ratios}, indent=1))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
