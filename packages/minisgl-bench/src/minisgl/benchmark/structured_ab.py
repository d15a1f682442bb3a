"""What grammar-constrained decoding costs: one `LLM`, one profile's requests, three arms
alternating (ABBA) in one run:

    python -m minisgl.benchmark.structured_ab --profile many-short --repeats 3 --out F.json

- `free`: no request constrained;
- `constrained`: every request under a small JSON schema (`SCHEMA`: one string property whose
  `minLength` no request reaches, so each one runs to its `max_tokens` like the free arm and
  the arms decode the same number of tokens);
- `mixed`: every other request constrained.

Greedy, the profile's prompts and output lengths, the prefix cache flushed before each run.
JSON: each arm's median wall time and output tok/s over the repeats, and the wall-time
ratios constrained / free (issue 38's goal: <= 1.3) and mixed / free (the unconstrained rows of
a mixed batch share its steps: <= 1.02 is "unaffected").
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from minisgl.benchmark import ab, common
from minisgl.benchmark.offline import flush_prefix_cache, make_llm
from minisgl.benchmark.profiles import PROFILES, build_workload, get_profile, warmup_workload

ARMS = ("free", "constrained", "mixed")
SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 4096}},
    "required": ["text"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "note", "schema": SCHEMA}}


def arm_params(arm: str, max_tokens: list[int]) -> list[Any]:
    """Greedy params of each request of `arm` (which are constrained: all, none, every other)."""
    from minisgl.core import SamplingParams

    def constrained(i: int) -> bool:
        return arm == "constrained" or (arm == "mixed" and i % 2 == 0)

    return [
        SamplingParams(temperature=0.0, max_tokens=n, response_format=RESPONSE_FORMAT)
        if constrained(i)
        else SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        for i, n in enumerate(max_tokens)
    ]


def run_arm(llm, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    flush_prefix_cache(llm)
    t0 = time.perf_counter()
    out = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    errors = [o["error"] for o in out if o.get("error")]
    tokens = sum(len(o["token_ids"]) for o in out)
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "errors": len(errors), "first_error": errors[0] if errors else None}  # fmt: skip


def _median(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Median wall time and tok/s; the first repeat's token count, every repeat's errors."""
    return ab.key_medians(("wall_s", "output_tok_s"))(reps) | {
        "output_tokens": reps[0]["output_tokens"],
        "errors": sum(x["errors"] for x in reps),
    }


def _setting(text: str) -> tuple[str, Any]:
    """`key=value` of an LLM keyword argument; integers as ints."""
    key, value = text.split("=", 1)
    return key, int(value) if value.lstrip("-").isdigit() else value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minisgl.benchmark.structured_ab")
    p.add_argument("--profile", default="many-short", choices=sorted(PROFILES))
    p.add_argument("--model-path", default=None, help="default: the embedded model")
    p.add_argument("--requests", type=int, default=None, help="override num_requests")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="LLM keyword arguments (e.g. dtype=float32)")  # fmt: skip
    p.add_argument("--out", help="result JSON path")
    args = p.parse_args(argv)
    overrides = {"num_requests": args.requests} if args.requests else {}
    profile = get_profile(args.profile, overrides)
    llm = make_llm(args.model_path, profile, dict(_setting(s) for s in args.set))
    vocab = llm.engine.model_config.vocab_size
    items = build_workload(profile, vocab)
    prompts = [it.prompt_ids for it in items]
    lengths = [it.max_tokens for it in items]
    warm = warmup_workload(profile, vocab)
    for arm in ARMS:  # grammar compile caches and every batch shape, before timing
        llm.generate([w.prompt_ids for w in warm], arm_params(arm, [w.max_tokens for w in warm]))
    runs = ab.interleave(
        ARMS, args.repeats, lambda a, _: run_arm(llm, prompts, arm_params(a, lengths))
    )
    cmp = ab.compare(runs, ("wall_s",), median=_median)
    record = {
        **common.record_header("structured-ab", argv),
        "tool": "structured_ab",
        "env": common.backend_env(),
        "profile": profile.name,
        "num_requests": profile.num_requests,
        "response_format": RESPONSE_FORMAT,
        "median": cmp.medians,
        "ratios": {
            "constrained_vs_free_wall": cmp.ratio["constrained"]["wall_s"],
            "mixed_vs_free_wall": cmp.ratio["mixed"]["wall_s"],
        },
        "repeats": runs,
    }
    ab.write(args.out, record)
    print(json.dumps({"median": cmp.medians, "ratios": record["ratios"]}, indent=1))
    same = len({m["output_tokens"] for m in cmp.medians.values()}) == 1
    return 0 if same and not any(m["errors"] for m in cmp.medians.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
