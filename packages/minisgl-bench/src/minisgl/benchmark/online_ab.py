"""Online A/B of CPU backends: one server per arm and repeat, the online benchmark against it.

    python -m minisgl.benchmark.harness online --ab python,rust_service \
        [--model-path DIR] [--sim-device [BASE_MS,TOKEN_MS]] --profile burst-256 \
        --repeats 3 --out F.json --plot F.png [--set key=value] [--server-arg=--page-size=16]

Each repeat starts every arm's server in turn (`MINISGL_CPU_BACKEND=<arm>`, ABBA order across
repeats so slow drifts in machine load cancel), waits for /health, runs the profile's workload
through the openai client in its own process (`benchmark/online.py`, `benchmark/client.py`), and
stops the server. The server is sized from the profile: `--max-running-requests` and
`--max-prefill-length` from it, a queue that holds every request, and KV pages for every running
request's longest sequence.

CPU: psutil CPU time (user + system) of every server process over the measured window, by
role (`CPU_COUNTING` below). Control plane = every server process except the rust_service
GPU workers. With `--sim-device` the python engine process (scheduler +
simulated engine, which sleeps through the device time) is all control plane; with a real
model it also holds the forward, so `cp_cpu_s_per_token` then bounds the control plane from
above for those arms only.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from minisgl.benchmark import ab, observe
from minisgl.benchmark.backends import ENV, check_server_backend
from minisgl.benchmark.client import (
    ClientJob,
    ClientLoad,
    ClientProcess,
    client_record,
    describe,
    mark_client,
    refusal,
)
from minisgl.benchmark.observations import arm_path, write_jsonl
from minisgl.benchmark.pooled import pooled_ttft
from minisgl.benchmark.profiles import Profile
from minisgl.benchmark.record import base_record, finish, model_info
from minisgl.benchmark.roles import server_roles
from minisgl.config import SimDevice

AB_KEYS = (
    "output_tok_s",
    "request_s",
    "ttft_ms.p50",
    "ttft_ms.p99",
    "tpot_ms.p50",
    "tpot_ms.p99",
    "e2e_ms.p99",
    "cpu.cp_cpu_s_per_token",
    "cpu.server_cpu_s_per_token",
)
PAIRED_AB_KEYS = ("output_tok_s", "ttft_ms.p99", "cpu.cp_cpu_s_per_token")
CPU_COUNTING = (
    "cpu_s.<role>: CPU seconds (user + system, psutil) over the measured window of each server "
    "process, by role: launcher (the `python -m minisgl` process: launcher + FastAPI API server), "
    "tokenizer (python tokenizer-detokenizer workers), scheduler (python "
    "scheduler + engine process), service (the Rust minisgl-cpu-service), "
    "gpu_worker (rust_service Python GPU workers), other (any other child, e.g. multiprocessing's "
    "resource tracker). cp_cpu_s = every role but gpu_worker; server_cpu_s = all roles; "
    "client_cpu_s = the benchmark client, a process of its own (not counted; "
    "client_cpu_core_frac = client_cpu_s / wall_s). *_per_token: divided by output tokens."
)
SERVICE_BINARY_ENV = "MINISGL_CPU_SERVICE_BIN"


def server_flags(profile: Profile, sim_device: str | None, extra: list[str]) -> list[str]:
    """Launch flags sized for the profile (they come after the test harness's defaults)."""
    longest = profile.prefix_len + profile.input_len_max + profile.output_len + 128  # + template
    running = profile.max_running_requests
    flags = [
        "--max-running-requests", str(running),
        "--max-queued-requests", str(profile.num_requests + profile.warmup_requests),
        "--max-prefill-length", str(profile.max_extend_tokens),
        "--max-seq-len-override", str(longest),
        "--num-pages", str(running * longest + longest),
        "--shutdown-timeout", "5",
    ]  # fmt: skip
    if sim_device is not None:
        flags += ["--sim-device", sim_device]
    return flags + extra


def sim_prefill_ms(sim: SimDevice | None, profile: Profile, metrics: dict) -> float | None:
    """The simulated device time before any first token when every prompt arrives at once and
    fits one prefill step (seed-online): base + token_ms x the prompt tokens the server counted
    (chat template included); None for other profiles (bursts chunked over several steps)."""
    if sim is None or profile.arrival != "all":
        return None
    if profile.concurrency and profile.concurrency < profile.num_requests:
        return None
    tokens = metrics.get("input_tokens")
    if not tokens or tokens > profile.max_extend_tokens:
        return None
    return sim.base_ms + sim.token_ms * float(tokens)


def per_token(metrics: dict[str, Any]) -> None:
    """Add `<x>_per_token` (CPU seconds per output token) to `metrics["cpu"]`."""
    cpu, n = metrics.get("cpu") or {}, metrics.get("output_tokens") or 0
    for key in ("cp_cpu_s", "server_cpu_s", "client_cpu_s"):
        if n and key in cpu:
            cpu[f"{key}_per_token"] = cpu[key] / n


def output_digest(texts: list[str]) -> str:
    """sha256 of every request's streamed text, in workload order (equal outputs, equal digest)."""
    return hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:16]


def run_arm(
    args: argparse.Namespace, arm: str, profile: Profile, log_dir: Path, client: ClientProcess
) -> dict[str, Any]:
    """Start `arm`'s server, run the workload once through the client process, stop the
    server; returns online `_run`'s output."""
    from minisgl.benchmark.online import prepare
    from minisgl.testing.server import running_server

    model_dir = args.model_path
    if model_dir is None:
        from minisgl.default_model import default_model_path

        model_dir = str(default_model_path())
    flags = server_flags(profile, args.sim_device, args.server_arg or [])
    with running_server(model_dir, *flags, log_dir=log_dir, env={ENV: arm}) as server:
        roles = server_roles(server)
        arm_args = argparse.Namespace(**vars(args))
        arm_args.base_url, arm_args.model, arm_args.model_path = server.base_url, None, model_dir
        prep = prepare(arm_args, profile)  # the tokenizer here, not in the client process
        out = client.run(ClientJob(arm_args, profile, prep, roles))  # RoleCpuMeter(roles)
        out["roles"] = {r: len(p) for r, p in roles.items()}
        out["info"] = server_info(server)
    per_token(out["metrics"])
    return out


def server_info(server) -> dict[str, Any]:
    import httpx

    with contextlib.suppress(httpx.HTTPError, ValueError):
        health = httpx.get(server.base_url + "/health", timeout=5).json()
        return {k: v for k, v in health.items() if k not in ("workers",)}
    return {}


def ab_record(args: argparse.Namespace, profile: Profile, arms: list[str]) -> dict[str, Any]:
    """The record's fields known before the run: arms, model, (simulated) device, server."""
    record = base_record("online-ab", args, profile)
    record |= {"model": model_info(args.model_path), "arms": arms}
    record["simulated_device"] = args.sim_device is not None
    if args.sim_device is not None:
        sim = SimDevice.parse(args.sim_device)
        record["sim_device"] = {
            "base_ms": sim.base_ms,
            "token_ms": sim.token_ms,
            "note": "SIMULATED DEVICE: no model runs; each step sleeps base_ms + token_ms per "
            "token and returns deterministic tokens (minisgl/engine/sim.py)",
        }
    record["server_flags"] = server_flags(profile, args.sim_device, args.server_arg or [])
    record["cpu_counting"] = CPU_COUNTING
    record["notes"] = args.note or []
    if SERVICE_BINARY_ENV in os.environ:
        record["service_binary"] = Path(os.environ[SERVICE_BINARY_ENV]).name
    return record


def arm_result(outs: list[dict[str, Any]], loads: list[ClientLoad]) -> dict[str, Any]:
    """One arm's result beside its median and repeats: the last repeat's samples and errors,
    every repeat's output digest, client load and TTFTs pooled."""
    from minisgl.benchmark.report import latency_samples

    samples = [latency_samples(o["items"], o["token_times"]) for o in outs]
    p50s = [o["metrics"]["ttft_ms"]["p50"] for o in outs if o["metrics"].get("ttft_ms")]
    return {
        "samples": samples[-1],
        "error_samples": outs[-1]["error_samples"],
        "output_digests": [output_digest(o["texts"]) for o in outs],
        "client_cpu_core_frac": [ld.core_frac for ld in loads],
        "client_saturated": [ld.saturated for ld in loads],
        "pooled": {"ttft_ms": pooled_ttft([s["ttft_ms"] for s in samples], p50s)},
    }


def write_observations(
    path: str, outs: list[dict[str, Any]], arm: str, profile: Profile, simulated: bool
) -> str:
    """Every repeat's observations of one arm (`observe.py`) in the arm's file; its path."""
    from minisgl.benchmark.online import stream_observations

    device = observe.device_label(simulated)
    observed = [
        ob
        for rep, o in enumerate(outs)
        for ob in stream_observations(o, observe.RunLabels(
            profile.name, arm, device, Path(o["model"]).name, "minisgl-online", rep))
    ]  # fmt: skip
    return str(write_jsonl(arm_path(path, arm), observed))


def print_report(results: dict[str, Any], identical: bool, digests: Any, client: str) -> None:
    """What the summary table leaves out: the outputs' agreement, the client, pooled TTFTs."""
    print(f"streamed outputs across arms and repeats: "
          f"{'identical' if identical else 'NOT identical'} ({digests})")  # fmt: skip
    print(client)
    for arm, r in results.items():
        t = r["pooled"]["ttft_ms"]
        over = r["pooled"].get("ttft_overhead_ms_p50")
        print(
            f"TTFT {arm}: pooled p50 {t['p50']} ms over {t['n']} requests; median of the "
            f"repeats' p50s, 95% interval {t['repeat_p50_ci95']}"
            + ("" if over is None else f"; overhead over the simulated prefill {over:.2f} ms")
        )


def run_online_ab(args: argparse.Namespace, profile: Profile) -> int:
    from minisgl.benchmark.report import print_summary

    arms = [a.strip() for a in args.ab.split(",") if a.strip()]
    if len(arms) < 2 or len(set(arms)) != len(arms):
        raise ValueError("--ab needs at least two distinct backends, e.g. python,rust_service")
    for arm in arms:
        check_server_backend(arm)
    record = ab_record(args, profile, arms)
    threshold = args.client_saturation_threshold
    with tempfile.TemporaryDirectory(prefix="ab-logs") as tmp, ClientProcess() as client:
        outs = ab.interleave(
            arms, args.repeats, lambda a, _: run_arm(args, a, profile, Path(tmp), client)
        )
        pids = client.pids
    loads = {
        a: [mark_client(o["metrics"], f"{a}#{i}", threshold) for i, o in enumerate(outs[a])]
        for a in arms
    }
    cmp = ab.compare({a: [o["metrics"] for o in outs[a]] for a in arms}, AB_KEYS, PAIRED_AB_KEYS)
    results = {a: r | arm_result(outs[a], loads[a]) for a, r in cmp.results().items()}
    sim = None if args.sim_device is None else SimDevice.parse(args.sim_device)
    prefill_ms = sim_prefill_ms(sim, profile, results[arms[0]]["metrics"])
    if prefill_ms is not None:
        record["sim_device"]["prefill_ms"] = prefill_ms
    for r in results.values():  # the median took the first repeat's flag
        r["metrics"].setdefault("cpu", {})["client_saturated"] = any(r["client_saturated"])
        if prefill_ms is not None and r["metrics"].get("ttft_ms"):
            r["pooled"]["ttft_overhead_ms_p50"] = r["metrics"]["ttft_ms"]["p50"] - prefill_ms
    record["results"] = results
    all_loads = [ld for arm in arms for ld in loads[arm]]
    refuse = args.refuse_saturated_client
    record["client"] = client_record(all_loads, threshold, refuse, pids, args.client)
    if args.observations:
        record["observations"] = {
            a: write_observations(args.observations, outs[a], a, profile, sim is not None)
            for a in arms
        }
    digests = {a: r["output_digests"] for a, r in results.items()}
    record["outputs_identical"] = len({d for ds in digests.values() for d in ds}) == 1
    record["servers"] = {a: {"roles": outs[a][-1]["roles"], **outs[a][-1]["info"]} for a in arms}
    record |= {"ab_ratio": cmp.ratio, "ab_ratio_paired": cmp.paired}
    record["gate_metrics"] = cmp.gate_metrics()
    print_summary(
        f"online A/B {profile.name}{'' if sim is None else ' SIMULATED DEVICE'}: "
        f"{' vs '.join(arms)} "
        f"({args.repeats} interleaved repeat(s), median)",
        {k: v["metrics"] for k, v in results.items()},
        cmp.tables(),
    )
    print_report(results, record["outputs_identical"], digests, describe(all_loads, threshold))
    status = finish(record, args, results)
    failed = {a: m["errors"] for a, m in ((a, r["metrics"]) for a, r in results.items())}
    if any(failed.values()):
        print(f"error: failed requests per arm (median): {failed}", file=sys.stderr)
        status = status or 1
    return refusal(all_loads, refuse) or status
