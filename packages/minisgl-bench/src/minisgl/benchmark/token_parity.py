"""Deterministic token parity: greedy decoding through two configurations, compared exactly.

    python -m minisgl.benchmark.token_parity --model-path DIR --backend-a python \
        --backend-b rust_hotpath --max-tokens 16 --token-prompt-count 4 \
        --min-input-len 32 --max-input-len 64 --cuda-graph-max-bs 1 --master-port 2380 \
        --out F.json

A side is a CPU backend (`python`, `rust_hotpath`: `MINISGL_CPU_BACKEND`, each side in a fresh
subprocess) or `hf` (HF transformers greedy `generate`, one prompt at a time), plus a prefix
cache type (`--cache-a/--cache-b radix|naive`) and optionally another model (`--model-path-b`).
Two prompt sets go through both sides: fixed text prompts and seeded random token prompts.
Exit status: 0 parity, 1 a mismatch, 2 a side cannot run (e.g. the Rust backend is missing).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl.benchmark import common
from minisgl.benchmark.backends import (
    ENV,
    KNOWN,
    BackendUnavailable,
    check_cpu_backend,
    ensure_backend,
    scheduler_backend,
)

TEXT_PROMPTS = [
    "Write one short sentence explaining why batching helps GPU utilization.",
    "The capital of France is",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Translate to French: The weather is nice today.",
    "Q: What is 12 times 7?\nA:",
    "A radix tree shares prefixes between prompts because",
]
# flags of the GPU runtime: accepted for command-line compatibility, recorded, unused on CPU
CPU_IGNORED = ("cuda_graph_max_bs", "master_port")


def token_prompts(count: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    tok_lo = min(100, vocab // 4)
    tok_hi = min(20000, vocab - 1)
    return [[rng.randint(tok_lo, tok_hi) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def build_sets(args: argparse.Namespace) -> tuple[dict[str, list[list[int]]], dict[str, Any]]:
    from transformers import AutoTokenizer

    from minisgl.config import ModelConfig

    path = resolve_model(args.model_path)
    tok = AutoTokenizer.from_pretrained(path)
    vocab = ModelConfig.from_dir(path).vocab_size
    texts = TEXT_PROMPTS[: args.text_prompt_count]
    sets = {
        "text_prompts": [list(tok(t)["input_ids"]) for t in texts],
        "token_prompts": token_prompts(
            args.token_prompt_count, args.min_input_len, args.max_input_len, vocab, args.seed
        ),
    }
    return sets, {"text_prompts": texts}


def resolve_model(path: str | None) -> str:
    if path:
        return path
    from minisgl.default_model import default_model_path

    return str(default_model_path())


# ------------------------------------------------------------------ one side
def generate_side(side: dict[str, Any], sets: dict[str, list[list[int]]], max_tokens: int):
    """Greedy token ids for every prompt of every set, in this process."""
    model_path = resolve_model(side["model_path"])
    if side["backend"] == "hf":
        from minisgl.testing.hf_reference import hf_greedy, load_hf_model

        model = load_hf_model(model_path, dtype=side.get("dtype") or "float32")
        return {name: hf_greedy(model, prompts, max_tokens) for name, prompts in sets.items()}
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    kwargs: dict[str, Any] = {"cache_type": side["cache"], "page_size": side["page_size"]}
    if side.get("dtype"):
        kwargs["dtype"] = side["dtype"]
    if side.get("num_pages"):
        kwargs["num_pages"] = side["num_pages"]
    check_cpu_backend(side["backend"])  # registers the in-process Rust arm when asked
    llm = LLM(model_path, **kwargs)
    ensure_backend(llm, side["backend"])
    side["active_backend"] = scheduler_backend(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = {}
    for name, prompts in sets.items():
        out[name] = [r["token_ids"] for r in llm.generate(prompts, params)]
    return out


def _side_in_subprocess(side, sets, max_tokens) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        result = Path(tmp) / "result.json"
        spec.write_text(json.dumps({"side": side, "sets": sets, "max_tokens": max_tokens}))
        env = dict(os.environ)
        if side["backend"] in KNOWN:
            env[ENV] = side["backend"]
        cmd = [sys.executable, "-m", "minisgl.benchmark.token_parity", "--worker", str(spec)]
        cmd += ["--worker-out", str(result)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(
                f"side {side['label']} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        return json.loads(result.read_text())


def run_side(side, sets, max_tokens, isolation: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    if isolation == "subprocess":
        data = _side_in_subprocess(side, sets, max_tokens)
    else:
        previous = os.environ.get(ENV)
        if side["backend"] in KNOWN:
            os.environ[ENV] = side["backend"]
        try:
            outputs = generate_side(side, sets, max_tokens)
            data = {"outputs": outputs, "env": common.backend_env()}
            data["active_backend"] = side.get("active_backend")
        finally:
            if previous is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = previous
    data["elapsed_s"] = time.perf_counter() - t0
    return data


# ------------------------------------------------------------------ compare
def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(out_a: dict[str, list[list[int]]], out_b: dict[str, list[list[int]]]) -> dict[str, Any]:
    sets: dict[str, Any] = {}
    for name in out_a:
        mismatches = []
        for idx, (a, b) in enumerate(zip(out_a[name], out_b[name], strict=True)):
            pos = first_diff(a, b)
            if pos is not None:
                mismatches.append(
                    {
                        "index": idx,
                        "first_diff_pos": pos,
                        "a_token": a[pos] if pos < len(a) else None,
                        "b_token": b[pos] if pos < len(b) else None,
                        "len_a": len(a),
                        "len_b": len(b),
                        "a_tail": a[pos : pos + 8],
                        "b_tail": b[pos : pos + 8],
                    }
                )
        sets[name] = {
            "prompts": len(out_a[name]),
            "mismatch_count": len(mismatches),
            "mismatches": mismatches,
        }
    return sets


def make_side(args: argparse.Namespace, which: str) -> dict[str, Any]:
    backend = getattr(args, f"backend_{which}")
    cache = getattr(args, f"cache_{which}")
    model = getattr(args, f"model_path_{which}", None) if which == "b" else None
    label = f"{backend}/{cache}" if backend != "hf" else "hf"
    return {
        "label": label,
        "backend": backend,
        "cache": cache,
        "page_size": args.page_size,
        "dtype": args.dtype,
        "num_pages": args.num_pages,
        "model_path": model or args.model_path,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minisgl.benchmark.token_parity")
    p.add_argument("--model-path", default=None, help="model dir (default: embedded SmolLM2)")
    p.add_argument("--model-path-b", default=None, help="another model for side B")
    choices = [*KNOWN, "hf"]
    p.add_argument("--backend-a", default="python", choices=choices)
    p.add_argument("--backend-b", default="rust_hotpath", choices=choices)
    p.add_argument("--cache-a", default="radix", choices=["radix", "naive"])
    p.add_argument("--cache-b", default="radix", choices=["radix", "naive"])
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--token-prompt-count", type=int, default=4)
    p.add_argument("--text-prompt-count", type=int, default=len(TEXT_PROMPTS))
    p.add_argument("--min-input-len", type=int, default=32)
    p.add_argument("--max-input-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--cuda-graph-max-bs", type=int, default=None, help="recorded; GPU only")
    p.add_argument("--master-port", type=int, default=None, help="recorded; unused here")
    p.add_argument("--isolation", choices=["subprocess", "in-process"], default="subprocess")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return p


def _worker(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    side = spec["side"]
    try:
        outputs = generate_side(side, spec["sets"], spec["max_tokens"])
    except BackendUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    common.write_json(
        out_path,
        {
            "outputs": outputs,
            "env": common.backend_env(),
            "active_backend": side.get("active_backend"),
        },
    )
    return 0


@dataclass(frozen=True)
class SideRun:
    """One side of the comparison: its settings (`make_side`) and its run (`run_side`:
    outputs, elapsed_s, env, active_backend)."""

    side: dict[str, Any]
    run: dict[str, Any]

    def record(self) -> dict[str, Any]:
        """The record's entry of this side: its settings, elapsed seconds and env, and the
        backend that served it when the run said."""
        out = {**self.side, "elapsed_s": self.run["elapsed_s"], "env": self.run.get("env")}
        if self.run.get("active_backend"):
            out["active_backend"] = self.run["active_backend"]
        return out


def _cannot_run(args: argparse.Namespace, sides: tuple[dict[str, Any], ...]) -> str | None:
    """The error line when the flags are inconsistent, a model folder has no config.json or a
    side's backend is unavailable (exit 2); None when both sides can run."""
    if not 1 <= args.min_input_len <= args.max_input_len:
        return "error: need 1 <= --min-input-len <= --max-input-len"
    for path in (args.model_path, args.model_path_b):
        if path and not Path(path, "config.json").is_file():
            return f"error: --model-path {path}: no config.json there"
    try:
        for side in sides:
            if side["backend"] != "hf":
                check_cpu_backend(side["backend"])
    except BackendUnavailable as exc:
        return f"error: cannot run token parity: {exc}"
    return None


def _parity_passed(result_sets: dict[str, Any]) -> bool:
    """True when no prompt of any set mismatched."""
    return all(s["mismatch_count"] == 0 for s in result_sets.values())


def _config(args: argparse.Namespace, text_prompt_count: int) -> dict[str, Any]:
    """The record's `config`: the run's settings, and the GPU-only flags ignored on CPU."""
    import torch

    on_gpu = torch.cuda.is_available()
    return {
        "max_tokens": args.max_tokens,
        "token_prompt_count": args.token_prompt_count,
        "text_prompt_count": text_prompt_count,
        "min_input_len": args.min_input_len,
        "max_input_len": args.max_input_len,
        "seed": args.seed,
        "isolation": args.isolation,
        "cuda_graph_max_bs": args.cuda_graph_max_bs,
        "master_port": args.master_port,
        "ignored_flags": [] if on_gpu else [f for f in CPU_IGNORED if getattr(args, f)],
    }


def _record(
    args: argparse.Namespace,
    argv: list[str] | None,
    a: SideRun,
    b: SideRun,
    result_sets: dict[str, Any],
    text_prompt_count: int,
) -> dict[str, Any]:
    """The run's JSON record: both sides, the per-set comparison and every output."""
    return {
        **common.record_header("token_parity", argv),
        "backend_env": common.backend_env(),
        "model": Path(resolve_model(args.model_path)).name,
        "parity_passed": _parity_passed(result_sets),
        "mismatches": sum(s["mismatch_count"] for s in result_sets.values()),
        "sides": {"a": a.record(), "b": b.record()},
        "config": _config(args, text_prompt_count),
        "sets": result_sets,
        "outputs": {"a": a.run["outputs"], "b": b.run["outputs"]},
    }


def _print_result(passed: bool, labels: tuple[str, str], result_sets: dict[str, Any]) -> None:
    """Prints the verdict and every set's mismatches; returns None."""
    print(f"parity_passed={passed}  ({labels[0]} vs {labels[1]})")
    for name, s in result_sets.items():
        print(f"{name} mismatch count: {s['mismatch_count']} / {s['prompts']}")
        for m in s["mismatches"]:
            print(
                f"  prompt {m['index']}: first difference at token {m['first_diff_pos']} "
                f"({m['a_token']} vs {m['b_token']})"
            )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.worker_out)
    side_a, side_b = make_side(args, "a"), make_side(args, "b")
    error = _cannot_run(args, (side_a, side_b))
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    sets, texts = build_sets(args)
    try:
        a = SideRun(side_a, run_side(side_a, sets, args.max_tokens, args.isolation))
        b = SideRun(side_b, run_side(side_b, sets, args.max_tokens, args.isolation))
    except (RuntimeError, BackendUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result_sets = compare(a.run["outputs"], b.run["outputs"])
    record = _record(args, argv, a, b, result_sets, len(texts["text_prompts"]))
    passed = _parity_passed(result_sets)
    _print_result(passed, (side_a["label"], side_b["label"]), result_sets)
    if args.out:
        common.write_json(args.out, record)
        print(f"wrote {args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
