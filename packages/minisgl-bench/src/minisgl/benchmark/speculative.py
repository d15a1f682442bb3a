"""Speculative decoding A/B, single stream: output tok/s without and with n-gram drafts on an
input-grounded prompt (repeat a passage of the prompt: drafts are copies) and a random-token
prompt (nothing to copy), interleaved ABBA rounds, medians; the outputs must be identical.

    python -m minisgl.benchmark.speculative [--model-path DIR] [--repeats 3] [--max-tokens 128]

Prints one JSON object: per workload both arms (median output tok/s, runs, acceptance) and the
ratio on / off.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from typing import Any

from minisgl.benchmark.common import abba_order, machine_info, median

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small "
    "brass lamp and a notebook in which he wrote down the colour of the sea, the direction of "
    "the wind and the names of the ships that passed the point. In winter the storms came "
    "from the north and the waves broke over the rocks below the tower, throwing spray as "
    "high as the gallery rail. In summer the sea was calm and the fishing boats went out "
    "before sunrise and came back at noon, their holds full of mackerel and herring. The "
    "keeper knew every captain by name and every boat by the shape of its sail."
)
WORKLOADS = ("input_grounded", "random_tokens")


def _prompts(llm: Any, seed: int = 0) -> dict[str, Any]:
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(seed)
    return {
        "input_grounded": [
            {"role": "user", "content": f"Repeat the following text exactly:\n\n{PASSAGE}"}
        ],
        "random_tokens": [rng.randrange(3, vocab) for _ in range(256)],
    }


def _run(llm: Any, prompt: Any, params: Any) -> tuple[list[int], float, dict[str, Any] | None]:
    before = llm.speculative_stats()
    out = llm.generate([prompt], params)[0]
    run = llm.last_run
    after = llm.speculative_stats()
    delta = None
    if after is not None and before is not None:
        delta = {k: after[k] - before[k] for k in ("verify_rows", "drafted_tokens",
                                                    "accepted_tokens")}  # fmt: skip
    return out["token_ids"], run["output_tokens"] / run["elapsed_s"], delta


def _arm(tok_s: list[float], counts: list[dict[str, Any]] | None) -> dict[str, Any]:
    arm: dict[str, Any] = {"output_tok_s": median(tok_s), "runs": tok_s}
    if counts is not None:
        rows = sum(c["verify_rows"] for c in counts)
        drafted = sum(c["drafted_tokens"] for c in counts)
        accepted = sum(c["accepted_tokens"] for c in counts)
        arm.update(
            verify_rows=rows,
            drafted_tokens=drafted,
            accepted_tokens=accepted,
            acceptance_rate=accepted / drafted if drafted else 0.0,
            mean_accepted_length=1 + accepted / rows if rows else 1.0,
        )
    return arm


def run(args: argparse.Namespace) -> dict[str, Any]:
    from minisgl import LLM, SamplingParams

    common = dict(dtype=args.dtype, threads=args.threads, max_running_requests=4)
    arms = {
        "off": LLM(args.model_path, **common),
        "on": LLM(
            args.model_path,
            **common,
            speculative_algorithm="ngram",
            speculative_num_draft_tokens=args.num_draft_tokens,
        ),
    }
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        prompts = _prompts(arms["off"])
        for llm in arms.values():  # warm: first-step costs out of the timed runs
            llm.generate([prompts["random_tokens"][:16]], SamplingParams(max_tokens=8))
        tok_s: dict[tuple[str, str], list[float]] = {}
        counts: dict[str, list[dict[str, Any]]] = {w: [] for w in WORKLOADS}
        outputs: dict[tuple[str, str], list[list[int]]] = {}
        for r in range(args.repeats):
            for w in WORKLOADS:
                for name in abba_order(list(arms), r):
                    ids, speed, delta = _run(arms[name], prompts[w], params)
                    tok_s.setdefault((w, name), []).append(speed)
                    outputs.setdefault((w, name), []).append(ids)
                    if delta is not None:
                        counts[w].append(delta)
    finally:
        for llm in arms.values():
            llm.close()
    report: dict[str, Any] = {
        "benchmark": "speculative",
        "machine": machine_info(),
        "model_path": str(args.model_path) if args.model_path else "embedded",
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "num_draft_tokens": args.num_draft_tokens,
        "repeats": args.repeats,
        "workloads": [],
    }
    for w in WORKLOADS:
        off, on = _arm(tok_s[(w, "off")], None), _arm(tok_s[(w, "on")], counts[w])
        report["workloads"].append(
            {
                "workload": w,
                "off": off,
                "on": on,
                "ratio": on["output_tok_s"] / off["output_tok_s"],
                "token_identical": outputs[(w, "off")] == outputs[(w, "on")],
            }
        )
    return report


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m minisgl.benchmark.speculative",
                                description=__doc__.splitlines()[0])  # fmt: skip
    p.add_argument("--model-path", default=None, help="default: the embedded model")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.max_tokens < 1:
        p.error("--repeats and --max-tokens must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    report = run(parse(argv))
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
