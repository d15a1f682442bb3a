"""Microbenchmark: typed schema vs the generic dataclass->dict path (encode + decode).

    python -m minisgl.benchmark.transport --out worklog/baselines/transport-cpu.json

Measures the messages on the hot path: a 1k-token AddReq (tokenizer -> scheduler), a 64-wide
TokenOut (scheduler -> detokenizer, once per step) and a 64-wide DetokOut (detokenizer -> API).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from minisgl.message.schema import AddReq, Codec, DetokOut, TokenOut, WireParams


def workloads(batch: int, prompt_len: int) -> dict:
    rng = np.random.default_rng(0)
    return {
        f"add_req_{prompt_len}tok": AddReq(
            7,
            rng.integers(0, 150000, prompt_len, dtype=np.int32),
            WireParams(temperature=0.7, max_tokens=128, stop=["\n\n"]),
        ),
        f"token_out_bs{batch}": TokenOut(
            np.arange(batch, dtype=np.int64),
            rng.integers(0, 150000, batch, dtype=np.int32),
            [None] * (batch - 1) + ["length"],
        ),
        f"detok_out_bs{batch}": DetokOut(
            list(range(batch)),
            ["tok"] * batch,
            [1] * batch,
            [None] * batch,
            [100] * batch,
        ),
    }


def bench(codec: Codec, msg, min_time: float) -> dict:
    data = codec.encode(msg)
    back = codec.decode(data)
    assert type(back) is type(msg)
    n, t0 = 0, time.perf_counter()
    while True:
        for _ in range(200):
            codec.decode(codec.encode(msg))
        n += 200
        el = time.perf_counter() - t0
        if el >= min_time:
            break
    return {"bytes": len(data), "roundtrip_us": round(el / n * 1e6, 3), "iters": n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minisgl.benchmark.transport")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    results = {}
    for name, msg in workloads(args.batch, args.prompt_len).items():
        typed = bench(Codec(True), msg, args.min_time)
        generic = bench(Codec(False), msg, args.min_time)
        results[name] = {
            "typed": typed,
            "generic": generic,
            "speedup": round(generic["roundtrip_us"] / typed["roundtrip_us"], 2),
        }
    report = {
        "benchmark": "transport",
        "what": "encode+decode round trip per message, typed schema vs generic dict path",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
