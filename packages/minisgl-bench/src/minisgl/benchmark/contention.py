"""One request's latency on a CPU that other processes also want (issue 59 item 4):

    python -m minisgl.benchmark.contention [--model-path DIR] [--threads 2] [--load N] \
        [--repeats 3] [--max-tokens 14] --out F.json

Two `LLM`s in this process, the same model and threads: `adapt` (`MINISGL_CPU_THREADS_ADAPT=1`:
each step's threads from what the other processes leave, `utils/cpu_share.py`) and `fixed` (the
default: the configured threads every step). Each repeat times one greedy
chat request of `--max-tokens` tokens through each arm on the quiet machine, then with `--load`
spinning processes beside it (default: twice the cores), arms interleaved. The record gives the
medians and each arm's loaded / quiet ratio beside the fair share, (load + threads) / cores: the
slowdown a process that waits for nobody would see. It prints the summary as JSON. A quiet
machine is one where nothing else runs: the record keeps the load average before each phase.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from minisgl.benchmark.common import record_header, write_json

ARMS = ("adapt", "fixed")
SPIN = "while True: pass"
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass(frozen=True)
class Timing:
    arm: str
    phase: str  # quiet | loaded
    repeat: int
    seconds: float
    tokens: int
    loadavg_1m: float


@contextlib.contextmanager
def spinning(n: int) -> Iterator[None]:
    """`n` processes spinning on the CPU until the block ends (killed and reaped after)."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    try:
        time.sleep(0.5)  # the load settles before the first timing
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _llm(arm: str, kw: dict[str, Any]) -> Any:
    from minisgl import LLM

    os.environ["MINISGL_CPU_THREADS_ADAPT"] = "1" if arm == "adapt" else "0"
    try:
        return LLM(**kw)
    finally:
        os.environ.pop("MINISGL_CPU_THREADS_ADAPT", None)


def _time(llm: Any, max_tokens: int) -> tuple[float, int]:
    from minisgl import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate([PROMPT], sp)
    return time.perf_counter() - t, len(out[0]["token_ids"])


def summarize(timings: list[Timing], cores: int, load: int, threads: int) -> dict[str, Any]:
    """Medians per arm and phase, each arm's loaded / quiet ratio, and the fair share."""
    out: dict[str, Any] = {"fair_share_ratio": (load + threads) / cores}
    for arm in sorted({t.arm for t in timings}):
        med = {
            phase: statistics.median(t.seconds for t in timings if (t.arm, t.phase) == (arm, phase))
            for phase in ("quiet", "loaded")
        }
        out[arm] = {"quiet_s": med["quiet"], "loaded_s": med["loaded"],
                    "loaded_over_quiet": med["loaded"] / med["quiet"]}  # fmt: skip
    if {"adapt", "fixed"} <= out.keys():
        out["fixed_over_adapt_loaded"] = out["fixed"]["loaded_s"] / out["adapt"]["loaded_s"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0))
    load = args.load if args.load is not None else 2 * cores
    kw: dict[str, Any] = {"threads": args.threads}
    if args.model_path:
        kw["model_path"] = args.model_path
    llms = {arm: _llm(arm, kw) for arm in ARMS}
    for llm in llms.values():  # warm: the first request's one-time work out of the timings
        _time(llm, args.max_tokens)
    timings: list[Timing] = []
    for r in range(args.repeats):
        for phase in ("quiet", "loaded"):
            ctx = spinning(load) if phase == "loaded" else contextlib.nullcontext()
            with ctx:
                la = os.getloadavg()[0]
                order = ARMS if r % 2 == 0 else ARMS[::-1]
                for arm in order:
                    s, n = _time(llms[arm], args.max_tokens)
                    timings.append(Timing(arm, phase, r, s, n, la))
    config = {"threads": args.threads, "load": load, "cores": cores, "repeats": args.repeats,
              "max_tokens": args.max_tokens, "model": args.model_path or "embedded"}  # fmt: skip
    record = {
        **record_header("contention"),
        "config": config,
        "timings": [asdict(t) for t in timings],
        "summary": summarize(timings, cores, load, args.threads),
    }
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None, help="an HF folder (default: the embedded model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--load", type=int, default=None, help="spinning processes (default: 2 x cores)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=14)
    ap.add_argument("--out", default=None, help="the JSON record")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.repeats < 1 or args.max_tokens < 1 or (args.load or 0) < 0:
        ap.error("--threads, --repeats and --max-tokens must be >= 1, --load >= 0")
    record = run(args)
    if args.out:
        write_json(args.out, record)
    print(json.dumps(record["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
