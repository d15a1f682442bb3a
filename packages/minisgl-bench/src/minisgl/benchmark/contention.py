"""One request's latency on a CPU that other processes also want (issue 59 item 4):

    python -m minisgl.benchmark.contention [--model-path DIR] [--threads 2] [--load N] \
        [--repeats 3] [--max-tokens 14] [--arm NAME=VAR=VALUE,...] --out F.json

Each arm is a process of its own holding one `LLM` (the same model and threads), started with
its environment: the OpenMP runtime reads its wait policy once, when torch loads it. The default
arms: `default` (minisgl's settings: PASSIVE after 1000 spins), `active` (`OMP_WAIT_POLICY=ACTIVE`: idle threads spin
between parallel regions, libgomp's own default), `passive` (`OMP_WAIT_POLICY=PASSIVE`: they
sleep at once) and `adapt` (`MINISGL_CPU_THREADS_ADAPT=1`: each step's threads from what the
other processes leave, `utils/cpu_share.py`). Each repeat times one greedy chat request of
`--max-tokens` tokens through every arm on the machine as it is (`quiet`), then with `--load`
spinning processes beside it (default: twice the cores), the arms in turn (their order rotated
each repeat), the other arms' processes stopped while one is timed. The record gives the medians, each arm's loaded / quiet ratio and the fair share,
(load + threads) / cores: the slowdown a process that waits for nobody would see. It prints the
summary as JSON. The load average before each phase is kept: `quiet` is only as quiet as the
machine was.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from minisgl.benchmark.common import record_header, write_json

SPIN = "while True: pass"
ARMS: dict[str, dict[str, str]] = {
    "default": {},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "adapt": {"MINISGL_CPU_THREADS_ADAPT": "1"},
}
# the arm's process: one LLM, warmed by one request, then one timed request per line of input
CHILD = """
import json, sys, time
from minisgl import LLM, SamplingParams
kw, max_tokens = json.loads(sys.argv[1]), int(sys.argv[2])
llm = LLM(**kw)
sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
prompt = [[{"role": "user", "content": "What is the capital of France?"}]]
llm.generate(prompt, sp)
print("READY", flush=True)
for _ in sys.stdin:
    t = time.perf_counter()
    out = llm.generate(prompt, sp)
    print(json.dumps([time.perf_counter() - t, len(out[0]["token_ids"])]), flush=True)
"""


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


# what `import minisgl` sets unless the caller did (`minisgl._sleeping_openmp`): this process
# imported minisgl, so its own values must not reach an arm that did not ask for them
OPENMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def arm_env(env: dict[str, str]) -> dict[str, str]:
    """An arm's process environment: this one's, less every variable an arm may set and the
    OpenMP ones, then the arm's own."""
    controlled = {var for arm in ARMS.values() for var in arm} | set(OPENMP_VARS) | set(env)
    return {**{k: v for k, v in os.environ.items() if k not in controlled}, **env}


@contextlib.contextmanager
def paused(procs: list[subprocess.Popen]) -> Iterator[None]:
    """`procs` stopped (SIGSTOP) for the block, resumed after: an idle arm must not take the
    cores of the arm being timed (an ACTIVE arm's threads spin for minutes after a request)."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for p in live:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)


class Arm:
    """One arm's process: `time()` runs one request there and returns (seconds, tokens)."""

    def __init__(self, name: str, env: dict[str, str], kw: dict[str, Any], max_tokens: int):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(kw), str(max_tokens)],
            env=arm_env(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip

    def ready(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip() == "READY":
                return
        raise RuntimeError(f"arm {self.name!r}: its process exited before it was ready "
                           f"(code {self.proc.wait()})")  # fmt: skip

    def time(self) -> tuple[float, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"arm {self.name!r}: its process exited (code {self.proc.wait()})")
        seconds, tokens = json.loads(line)
        return float(seconds), int(tokens)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def summarize(timings: list[Timing], cores: int, load: int, threads: int) -> dict[str, Any]:
    """Medians per arm and phase, each arm's loaded / quiet ratio, and the fair share."""
    out: dict[str, Any] = {"fair_share_ratio": (load + threads) / cores}
    for arm in dict.fromkeys(t.arm for t in timings):
        med = {
            phase: statistics.median(t.seconds for t in timings if (t.arm, t.phase) == (arm, phase))
            for phase in ("quiet", "loaded")
        }
        out[arm] = {"quiet_s": med["quiet"], "loaded_s": med["loaded"],
                    "loaded_over_quiet": med["loaded"] / med["quiet"]}  # fmt: skip
    return out


def parse_arm(text: str) -> tuple[str, dict[str, str]]:
    """`NAME=VAR=VALUE,VAR=VALUE` (or a default arm's NAME) -> (name, its environment)."""
    name, _, rest = text.partition("=")
    if not name:
        raise ValueError(f"--arm {text!r}: NAME=VAR=VALUE,...")
    if not rest:
        if name not in ARMS:
            raise ValueError(f"--arm {text!r}: not one of {sorted(ARMS)}; or NAME=VAR=VALUE,...")
        return name, ARMS[name]
    env = {}
    for pair in rest.split(","):
        var, eq, value = pair.partition("=")
        if not var or not eq:
            raise ValueError(f"--arm {text!r}: {pair!r} is not VAR=VALUE")
        env[var] = value
    return name, env


def run(args: argparse.Namespace, arms: dict[str, dict[str, str]]) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0))
    load = args.load if args.load is not None else 2 * cores
    kw: dict[str, Any] = {"threads": args.threads}
    if args.model_path:
        kw["model_path"] = args.model_path
    procs = [Arm(name, env, kw, args.max_tokens) for name, env in arms.items()]
    timings: list[Timing] = []
    try:
        for p in procs:
            p.ready()
        for r in range(args.repeats):
            for phase in ("quiet", "loaded"):
                with spinning(load) if phase == "loaded" else contextlib.nullcontext():
                    la = os.getloadavg()[0]
                    k = r % len(procs)
                    for p in procs[k:] + procs[:k]:
                        with paused([q.proc for q in procs if q is not p]):
                            s, n = p.time()
                        timings.append(Timing(p.name, phase, r, s, n, la))
    finally:
        for p in procs:
            p.close()
    config = {"threads": args.threads, "load": load, "cores": cores, "repeats": args.repeats,
              "max_tokens": args.max_tokens, "model": args.model_path or "embedded",
              "arms": arms}  # fmt: skip
    return {
        **record_header("contention"),
        "config": config,
        "timings": [asdict(t) for t in timings],
        "summary": summarize(timings, cores, load, args.threads),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None, help="an HF folder (default: the embedded model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--load", type=int, default=None, help="spinning processes (default: 2 x cores)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=14)
    ap.add_argument("--arm", action="append", default=None,
                    help=f"NAME=VAR=VALUE,... or one of {sorted(ARMS)} (default: all of those)")  # fmt: skip
    ap.add_argument("--out", default=None, help="the JSON record")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.repeats < 1 or args.max_tokens < 1 or (args.load or 0) < 0:
        ap.error("--threads, --repeats and --max-tokens must be >= 1, --load >= 0")
    try:
        arms = dict(parse_arm(a) for a in args.arm) if args.arm else dict(ARMS)
    except ValueError as e:
        ap.error(str(e))
    record = run(args, arms)
    if args.out:
        write_json(args.out, record)
    print(json.dumps(record["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
