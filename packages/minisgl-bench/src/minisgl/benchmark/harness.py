"""The benchmark harness.

    python -m minisgl.benchmark.harness offline --out F.json --gate G.yaml \
        [--profile seed-offline] [--model-path DIR] [--engine minisgl|hf|llamacpp] \
        [--ab python,rust_hotpath] [--repeats N] [--plot F.png] [--set key=value ...]
    python -m minisgl.benchmark.harness online --base-url http://127.0.0.1:1919 \
        --out F.json --gate G.yaml [--profile seed-online] [--set key=value ...]
    python -m minisgl.benchmark.harness online --ab python,rust_service \
        [--model-path DIR] [--sim-device [BASE_MS,TOKEN_MS]] --profile burst-256 --repeats 3 \
        --out F.json --plot F.png   (starts a server per arm and repeat: `online_ab.py`)

`--observations F.jsonl` writes one observation per request and repeat (`observations.py`,
`observe.py`) for the release gate (`release_gate.py`); with `--ab`, one file per arm:
`F.<arm>.jsonl` (e.g. F.python.jsonl, F.rust_service.jsonl). Request ids are
`<profile>-<index>`, the same for every run and backend of one workload.

`--sim-device`: no model runs; each step takes a fixed time and returns deterministic tokens
(`engine/sim.py`); the results are labelled `simulated_device: true`.

`--set` overrides profile parameters (see `profiles.Profile`) and, with an `llm.` prefix, LLM
constructor arguments (`--set llm.page_size=16`). Exit status: 0 ok, 1 a gate failed (or a
gated metric is missing), 2 bad usage or an unavailable backend, 3 (online, with
`--refuse-saturated-client`) the load generator saturated its core (`client.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl.benchmark import ab, common, observe
from minisgl.benchmark.backends import (
    ENV,
    BackendUnavailable,
    check_cpu_backend,
    ensure_backend,
    scheduler_backend,
)
from minisgl.benchmark.client import REFUSED_EXIT, SATURATION_CORE_FRAC
from minisgl.benchmark.llamacpp import LlamaCppUnavailable
from minisgl.benchmark.observations import Observation, arm_path, read_jsonl, write_jsonl
from minisgl.benchmark.profiles import (
    PROFILES,
    Profile,
    WorkItem,
    build_workload,
    get_profile,
    warmup_workload,
)
from minisgl.benchmark.record import (
    RATIO_KEYS,
    base_record,
    finish,
    median_nested,
    model_info,
    split_sets,
)
from minisgl.benchmark.report import Progress, latency_samples, print_summary
from minisgl.config import QUANTIZATION_METHODS
from minisgl.utils.threads import set_threads

# --------------------------------------------------------------------------- helpers
PAIRED_KEYS = ("output_tok_s", "output_tok_per_cpu_s")


def offline_observations(
    record: dict[str, Any],
    profile: Profile,
    items: list[WorkItem],
    out: dict[str, Any],
    repeat: int,
    honor_arrivals: bool,
) -> list[Observation]:
    """The observations of one offline repeat (`observe.py` says what the timings mean)."""
    labels = observe.RunLabels(
        profile=profile.name,
        backend=record["cpu_backend"],
        device=observe.device_label(record["simulated_device"]),
        model=record["model"]["name"],
        source="minisgl-offline",
        repeat=repeat,
        extra={"dtype": record["model"].get("dtype"), "seed": profile.seed},
    )
    arrivals = [i.arrival_s if honor_arrivals else 0.0 for i in items]
    return observe.build(
        items,
        out["token_times"],
        labels,
        arrivals=arrivals,
        token_ids=out["token_ids"],
        kv_samples=out["kv_samples"],
    )


# --------------------------------------------------------------------------- offline
@dataclass(frozen=True)
class OfflineRuns:
    """The repeats of an offline run: each engine's metrics a repeat (minisgl, then the
    baseline engine's), the latency samples of each one's last repeat, and minisgl's
    observations (--observations)."""

    runs: dict[str, list[dict[str, Any]]]
    samples: dict[str, Any]
    observed: list[Observation]


def _llm_kwargs(args: argparse.Namespace, llm_sets: dict[str, Any]) -> dict[str, Any]:
    """The LLM constructor arguments: the `--set llm.*` overrides, then the flags that name
    one (an override of the same argument wins)."""
    flags = {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "cuda_graph_max_bs": args.cuda_graph_max_bs,
        "dummy_weights": True if args.dummy_weights else None,
        "sim_device": args.sim_device,
        "speculative_algorithm": args.speculative_algorithm,
        "speculative_num_draft_tokens": args.speculative_num_draft_tokens,
        "speculative_draft_model_path": args.speculative_draft_model_path,
    }
    llm_kwargs = dict(llm_sets)
    for key, value in flags.items():
        if value is not None:
            llm_kwargs.setdefault(key, value)
    return llm_kwargs


def _start_llm(
    args: argparse.Namespace,
    profile: Profile,
    llm_kwargs: dict[str, Any],
    requested: str,
    record: dict[str, Any],
):
    """The run's minisgl `LLM` on the `requested` CPU backend; `record` gets its init time,
    backend, dtype, device and engine config."""
    from minisgl.benchmark.offline import make_llm

    t0 = time.perf_counter()
    llm = make_llm(args.model_path, profile, llm_kwargs)
    record["init_s"] = time.perf_counter() - t0
    ensure_backend(llm, requested)
    record["cpu_backend"] = scheduler_backend(llm)
    record["model"].update({"dtype": str(llm.engine.dtype), "device": str(llm.engine.device)})
    record["engine_config"] = {
        k: getattr(llm.config, k) for k in vars(llm.config) if not k.startswith("_")
    }
    record["engine_config"]["model_path"] = Path(llm.config.model_path).name  # no abs. paths
    return llm


def _base_runner(
    args: argparse.Namespace, profile: Profile, record: dict[str, Any], llm
) -> Callable[..., dict[str, Any]] | None:
    """The baseline engine's `run(items, progress)` (--engine hf / llamacpp); None for
    --engine minisgl."""
    if args.engine == "hf":
        return _hf_runner(args, profile, record, llm)
    if args.engine == "llamacpp":
        return _llamacpp_runner(args, profile, record)
    return None


def _run_repeats(
    args: argparse.Namespace, profile: Profile, record: dict[str, Any], llm
) -> OfflineRuns:
    """The warm-up, then `--repeats` repeats of the workload through minisgl (at its arrival
    times unless --ignore-arrivals) and the baseline engine (all at t=0)."""
    from minisgl.benchmark.offline import run_minisgl

    vocab = llm.engine.model_config.vocab_size
    items = build_workload(profile, vocab)
    at_zero = [dataclasses.replace(i, arrival_s=0.0) for i in items]  # baselines: all at t=0
    warm = warmup_workload(profile, vocab)
    run_base = _base_runner(args, profile, record, llm)
    base = args.engine
    runs: dict[str, list[dict[str, Any]]] = {"minisgl": []}
    if run_base is not None:
        runs[base] = []
    samples: dict[str, Any] = {}
    honor = not args.ignore_arrivals
    observed: list[Observation] = []
    with Progress(not args.no_progress) as prog:
        run_minisgl(llm, warm, honor_arrivals=False)
        if run_base is not None:
            run_base(warm)
        for rep in range(args.repeats):
            out = run_minisgl(llm, items, prog.task(f"minisgl #{rep + 1}", len(items)), honor)
            runs["minisgl"].append(out["metrics"])
            samples["minisgl"] = latency_samples(items, out["token_times"])
            if args.observations:
                observed += offline_observations(record, profile, items, out, rep, honor)
            if run_base is not None:
                out = run_base(at_zero, prog.task(f"{base} #{rep + 1}", len(items)))
                runs[base].append(out["metrics"])
                samples[base] = latency_samples(at_zero, out["token_times"])
    return OfflineRuns(runs, samples, observed)


def _speedups(
    record: dict[str, Any], runs: OfflineRuns, results: dict[str, Any], base: str
) -> dict[str, dict[str, float]]:
    """The ratio tables of minisgl against the baseline engine (none without one); `record`
    gets `speedup_vs_<base>` (ratio of medians) and `speedup_vs_<base>_paired`."""
    if base not in results:
        return {}
    speed = common.ratios(results[base]["metrics"], results["minisgl"]["metrics"], RATIO_KEYS)
    record[f"speedup_vs_{base}"] = speed
    paired = common.paired_ratios(runs.runs[base], runs.runs["minisgl"], PAIRED_KEYS)
    record[f"speedup_vs_{base}_paired"] = paired
    return {
        f"minisgl / {base} (ratio of medians)": speed,
        f"minisgl / {base} (median of paired repeats)": {
            k: v for k, v in paired.items() if not k.endswith("_per_repeat")
        },
    }


def _offline_gate_metrics(
    record: dict[str, Any], results: dict[str, Any], base: str
) -> dict[str, Any]:
    """The gated metrics of an offline run: minisgl's; with a baseline engine, its metrics
    (`<base>.`) and the speedups; with speculation, its numeric counters (`speculative.`)."""
    gate_metrics = common.flatten(results["minisgl"]["metrics"])
    if base in results:
        gate_metrics.update(common.flatten(results[base]["metrics"], f"{base}."))
        for key in (f"speedup_vs_{base}", f"speedup_vs_{base}_paired"):
            gate_metrics.update(common.flatten(record[key], f"{key}."))
    if record["speculative"] is not None:
        gate_metrics.update(common.flatten(
            {k: v for k, v in record["speculative"].items() if isinstance(v, int | float)},
            "speculative.",
        ))  # fmt: skip
    return gate_metrics


def _print_offline(
    args: argparse.Namespace,
    profile: Profile,
    record: dict[str, Any],
    results: dict[str, Any],
    ratio_tables: dict[str, dict[str, float]],
) -> None:
    """Prints the summary table and, against a baseline engine, the paired speedup line;
    returns None."""
    print_summary(
        f"offline {profile.name} ({record['model']['name']}, {args.repeats} repeat(s), median)",
        {k: v["metrics"] for k, v in results.items()},
        ratio_tables,
    )
    base = args.engine
    if base in results:
        s = record[f"speedup_vs_{base}_paired"].get("output_tok_s")
        c = record[f"speedup_vs_{base}_paired"].get("output_tok_per_cpu_s")
        if s:
            print(f"minisgl / {base} output tok/s = {s:.2f}x (median of paired repeats)", end="")
            print(f"; per CPU-second {c:.2f}x" if c else "")


def run_offline(args: argparse.Namespace) -> int:
    profile_sets, llm_sets = split_sets(args.set)
    profile = get_profile(args.profile, profile_sets)
    if args.ab:
        return run_ab(args, profile)
    llm_kwargs = _llm_kwargs(args, llm_sets)
    requested = os.environ.get(ENV, "python").strip() or "python"
    check_cpu_backend(requested)
    record = base_record("offline", args, profile)
    record["engine"] = args.engine
    record["simulated_device"] = llm_kwargs.get("sim_device") is not None
    record["model"] = model_info(args.model_path)
    record["llm_kwargs"] = llm_kwargs
    llm = _start_llm(args, profile, llm_kwargs, requested, record)
    runs = _run_repeats(args, profile, record, llm)
    results = {
        name: {"metrics": median_nested(reps), "repeats": reps, "samples": runs.samples[name]}
        for name, reps in runs.runs.items()
    }
    record["results"] = results
    ratio_tables = _speedups(record, runs, results, args.engine)
    record["speculative"] = llm.speculative_stats()  # None without speculation
    record["gate_metrics"] = _offline_gate_metrics(record, results, args.engine)
    if args.observations:
        record["observations"] = str(write_jsonl(args.observations, runs.observed))
    try:
        from minisgl.scheduler import cpu_backend

        record["cpu_backend_stats"] = cpu_backend.stats()
    except ImportError:
        pass
    _print_offline(args, profile, record, results, ratio_tables)
    return finish(record, args, results)


def _hf_runner(args: argparse.Namespace, profile: Profile, record: dict[str, Any], llm):
    from minisgl.benchmark.offline import load_hf, run_hf

    hf_dtype = args.hf_dtype or str(llm.engine.dtype).split(".")[-1]
    hf_model = load_hf(llm.config.model_path, hf_dtype, llm.config.dummy_weights,
                       str(llm.engine.device))  # fmt: skip
    record["hf_dtype"] = hf_dtype
    pad = llm.tokenizer.pad_token_id
    pad = 0 if pad is None else int(pad)

    def run(work, adv=None):
        return run_hf(hf_model, work, profile.hf_batch_size, pad, adv)

    return run


def _llamacpp_runner(args: argparse.Namespace, profile: Profile, record: dict[str, Any]):
    """`run(items, progress)` of the llama.cpp arm on the embedded model's GGUF (or --gguf)."""
    import torch

    from minisgl.benchmark.llamacpp import llamacpp_info, load_llamacpp, run_llamacpp

    if args.gguf:
        gguf = Path(args.gguf)
    elif args.model_path is None:
        from minisgl.default_model import gguf_path

        gguf = gguf_path()
    else:
        raise ValueError("--engine llamacpp with --model-path needs --gguf FILE (same weights)")
    threads = args.threads or torch.get_num_threads()
    n_ctx = profile.prefix_len + profile.input_len_max + profile.output_len + 64
    model = load_llamacpp(gguf, threads, n_ctx=max(n_ctx, 512))
    record["llamacpp"] = {"gguf": gguf.name, "threads": threads, **llamacpp_info()}

    def run(work, adv=None):
        return run_llamacpp(model, work, adv)

    return run


def _arm_command(
    args: argparse.Namespace, profile: Profile, out: str, obs_out: str | None = None
) -> list[str]:
    cmd = [sys.executable, "-m", "minisgl.benchmark.harness", "offline", "--out", out]
    cmd += ["--profile", profile.name, "--repeats", "1", "--no-progress"]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.ignore_arrivals:
        cmd += ["--ignore-arrivals"]
    if args.sim_device is not None:
        cmd += ["--sim-device", args.sim_device]
    if obs_out is not None:
        cmd += ["--observations", obs_out]
    if getattr(args, "dummy_weights", False):
        cmd += ["--dummy-weights"]
    for item in args.set or []:
        cmd += ["--set", item]
    return cmd


def run_ab(args: argparse.Namespace, profile: Profile) -> int:
    arms = [a.strip() for a in args.ab.split(",") if a.strip()]
    if len(arms) < 2:
        raise SystemExit("--ab needs at least two backends, e.g. --ab python,rust_hotpath")
    for arm in arms:
        check_cpu_backend(arm)
    record = base_record("offline-ab", args, profile)
    record |= {"model": model_info(args.model_path), "arms": arms}
    record["simulated_device"] = args.sim_device is not None
    with tempfile.TemporaryDirectory() as tmp:

        def one(arm: str, rep: int) -> tuple[dict[str, Any], list[Observation]]:
            """One arm's repeat in a process of its own: its record and observations."""
            out = os.path.join(tmp, f"{arm}-{rep}.json")
            obs_out = os.path.join(tmp, f"{arm}-{rep}.jsonl") if args.observations else None
            cmd = _arm_command(args, profile, out, obs_out)
            subprocess.run(cmd, env={**os.environ, ENV: arm}, check=True)
            observed = read_jsonl(obs_out) if obs_out is not None else []
            data = json.loads(Path(out).read_text())
            return data, [dataclasses.replace(o, repeat=rep) for o in observed]

        try:
            outs = ab.interleave(arms, args.repeats, one)
        except subprocess.CalledProcessError as e:
            print(f"an arm failed with exit status {e.returncode}", file=sys.stderr)
            return 2
    cmp = ab.compare(
        {a: [d["results"]["minisgl"]["metrics"] for d, _ in outs[a]] for a in arms},
        RATIO_KEYS,
        PAIRED_KEYS,
    )
    results = {
        a: r | {"samples": outs[a][-1][0]["results"]["minisgl"]["samples"]}
        for a, r in cmp.results().items()
    }
    record["results"] = results
    record["arm_env"] = {a: outs[a][-1][0]["backend_env"] for a in arms}
    if args.observations:
        record["observations"] = {
            a: str(
                write_jsonl(arm_path(args.observations, a), [o for _, obs in outs[a] for o in obs])
            )
            for a in arms
        }
    record |= {"ab_ratio": cmp.ratio, "ab_ratio_paired": cmp.paired}
    record["gate_metrics"] = common.flatten(cmp.medians[arms[0]]) | cmp.gate_metrics(len(arms) > 2)
    print_summary(
        f"A/B {profile.name}: {' vs '.join(arms)} ({args.repeats} interleaved repeat(s), median)",
        {k: v["metrics"] for k, v in results.items()},
        cmp.tables(),
    )
    return finish(record, args, results)


# --------------------------------------------------------------------------- online
def run_online(args: argparse.Namespace) -> int:
    """The online benchmark against a running server (`--base-url`), the client in a process
    of its own (`client.py`)."""
    from minisgl.benchmark import client as bench_client
    from minisgl.benchmark.online import prepare, server_backend, stream_observations

    profile_sets, llm_sets = split_sets(args.set)
    if llm_sets:
        raise ValueError("llm.* overrides apply to the server's launch flags, not to online runs")
    profile = get_profile(args.profile, profile_sets)
    record = base_record("online", args, profile)
    record["base_url"] = args.base_url
    reps: list[dict[str, Any]] = []
    last: dict[str, Any] = {}
    last_items: list[WorkItem] = []
    observed: list[Observation] = []
    loads: list[bench_client.ClientLoad] = []
    threshold = args.client_saturation_threshold
    with bench_client.ClientProcess() as client:
        for rep in range(args.repeats):
            last = client.run(bench_client.ClientJob(args, profile, prepare(args, profile)))
            loads.append(bench_client.mark_client(last["metrics"], f"online#{rep}", threshold))
            if args.observations:
                backend = server_backend(args.base_url)
                labels = observe.RunLabels(
                    profile.name, backend, observe.device_label(False),
                    Path(last["model"]).name, "minisgl-online", rep,
                )  # fmt: skip
                observed += stream_observations(last, labels)
            last_items = last.pop("items")
            reps.append(last["metrics"])
        pids = client.pids
    if args.observations:
        record["observations"] = str(write_jsonl(args.observations, observed))
    metrics = median_nested(reps)
    metrics["cpu"]["client_saturated"] = any(ld.saturated for ld in loads)  # not the first's
    refuse = args.refuse_saturated_client
    record["client"] = bench_client.client_record(loads, threshold, refuse, pids, args.client)
    record["model"] = {"name": Path(last["model"]).name, "tokenizer": last["tokenizer"]}
    record["results"] = {
        "online": {
            "metrics": metrics,
            "repeats": reps,
            "samples": latency_samples(last_items, last["token_times"]),
        }
    }
    record["error_samples"] = last["error_samples"]
    record["gate_metrics"] = common.flatten(metrics)
    print_summary(
        f"online {profile.name} ({Path(last['model']).name}, {args.repeats} repeat(s), median)",
        {"online": metrics},
        None,
    )
    status = finish(record, args, record["results"])
    if metrics.get("errors"):
        print(f"error: {metrics['errors']} request(s) failed, e.g. {last['error_samples'][0]}")
        status = status or 1
    print(bench_client.describe(loads, threshold))
    return bench_client.refusal(loads, refuse) or status


# --------------------------------------------------------------------------- CLI
def _add_common_args(p: argparse.ArgumentParser, default_profile: str) -> None:
    """Adds the flags of both modes to `p`; returns None."""
    p.add_argument("--out", help="result JSON path")
    p.add_argument("--gate", action="append", help="gates YAML (repeatable)")
    p.add_argument("--baseline", help="result JSON for relative gates on the same metric")
    p.add_argument("--allow-missing", action="store_true", help="missing metrics pass")
    p.add_argument("--profile", default=default_profile, choices=sorted(PROFILES))
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--plot", help="PNG with latency CDFs and throughput bars")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--model-path", default=None, help="model dir (default: embedded)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument(
        "--observations",
        metavar="F.jsonl",
        default=None,
        help="per-request observations for the release gate (--ab: F.<arm>.jsonl per arm)",
    )
    p.add_argument(
        "--sim-device",
        nargs="?",
        const="default",
        default=None,
        metavar="BASE_MS[,TOKEN_MS]",
        help="simulated device: no model, fixed step time (default 0.5,0.002 ms)",
    )


def _add_offline_args(off: argparse.ArgumentParser) -> None:
    """Adds the flags of the offline mode only to `off`; returns None."""
    off.add_argument(
        "--engine",
        choices=["minisgl", "hf", "llamacpp"],
        default="minisgl",
        help="hf: also run HF transformers generate on the same workload; llamacpp: also "
        "llama-cpp-python on the GGUF (opt-in extra: minisgl[llamacpp])",
    )
    off.add_argument("--gguf", default=None, help="llamacpp: GGUF file (default: embedded)")
    off.add_argument("--dtype", default=None, help="minisgl dtype (LLM dtype=...)")
    off.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS, help="minisgl")
    off.add_argument("--hf-dtype", default=None, help="HF dtype (default: minisgl's dtype)")
    off.add_argument("--ab", help="comma-separated CPU backends, e.g. python,rust_hotpath")
    off.add_argument("--ignore-arrivals", action="store_true", help="submit all at t=0")
    off.add_argument("--cuda-graph-max-bs", type=int, default=None)
    off.add_argument("--speculative-algorithm", default=None, help="minisgl: ngram / draft")
    off.add_argument(
        "--speculative-draft-model-path", default=None, help="minisgl: the draft algorithm's model"
    )
    off.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="minisgl: k")
    off.add_argument(
        "--dummy-weights",
        action="store_true",
        help="random weights of config.json's shapes (LLM dummy_weights=True; HF: its own init)",
    )


def _add_online_args(on: argparse.ArgumentParser) -> None:
    """Adds the flags of the online mode only to `on`; returns None."""
    on.add_argument("--base-url", default="http://127.0.0.1:1919")
    on.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    on.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="server (launcher) pid: CPU %% of it and its children",
    )
    on.add_argument("--api-key", default="EMPTY")
    on.add_argument(
        "--client",
        default="lean",
        choices=["lean", "openai"],
        help="load generator: lean (aiohttp, one json.loads a line, as SGLang's and vLLM's "
        "serving benchmarks) or the openai SDK (a pydantic model a chunk)",
    )
    on.add_argument("--timeout", type=float, default=600.0)
    on.add_argument(
        "--ab",
        help="comma-separated CPU backends (python, rust_service): start a server "
        "per arm and repeat (ABBA order) instead of using --base-url",
    )
    on.add_argument(
        "--server-arg",
        action="append",
        metavar="FLAG",
        help="--ab: an extra `python -m minisgl` flag, e.g. --server-arg=--page-size=16",
    )
    on.add_argument("--note", action="append", help="--ab: a note stored in the JSON")
    on.add_argument(
        "--client-saturation-threshold",
        type=float,
        default=SATURATION_CORE_FRAC,
        metavar="CORES",
        help="the load generator (its own process) counts as saturated above this CPU, in "
        "cores over the measured window: the run is flagged (default %(default)s)",
    )
    on.add_argument(
        "--refuse-saturated-client",
        action="store_true",
        help=f"a run whose client saturated fails (exit {REFUSED_EXIT}) instead of a warning",
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m minisgl.benchmark.harness`: the offline and online
    modes."""
    parser = argparse.ArgumentParser(prog="python -m minisgl.benchmark.harness")
    sub = parser.add_subparsers(dest="mode", required=True)
    off = sub.add_parser("offline", help="in-process LLM benchmark")
    _add_common_args(off, "seed-offline")
    _add_offline_args(off)
    on = sub.add_parser("online", help="OpenAI-API benchmark against a running server")
    _add_common_args(on, "seed-online")
    _add_online_args(on)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        print("--repeats must be >= 1", file=sys.stderr)
        return 2
    if args.threads:
        set_threads(args.threads)
    try:
        if args.sim_device is not None:
            from minisgl.config import SimDevice

            SimDevice.parse(args.sim_device)
        if args.mode == "offline":
            return run_offline(args)
        if args.ab:
            from minisgl.benchmark.online_ab import run_online_ab

            profile_sets, llm_sets = split_sets(args.set)
            if llm_sets:
                raise ValueError("llm.* overrides do not apply online; use --server-arg")
            return run_online_ab(args, get_profile(args.profile, profile_sets))
        if args.sim_device is not None:
            raise ValueError("online --sim-device applies with --ab (pass it to the server)")
        return run_online(args)
    except (ValueError, BackendUnavailable, LlamaCppUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
