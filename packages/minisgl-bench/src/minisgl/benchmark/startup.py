"""How long `LLM()` takes to be ready, on empty caches and on warm ones (issue 35 item 3):

    python -m minisgl.benchmark.startup [--model-path DIR] [--repeats 3] [--threads 2] \
        [--set KEY=VALUE] --out F.json

Each run is a fresh Python process, timed from its start: `import_s` (`from minisgl import LLM`),
`llm_s` (`LLM(...)`: for the embedded model on empty caches, the GGUF's conversion, the packing
and the C kernels' build) and `process_s` (the whole process, interpreter start-up and exit
included). A repeat is a cold run on new, empty caches (`MINISGL_CACHE_DIR`,
`MINISGL_KERNEL_CACHE`: a temp dir each; a `--model-path` folder copied there without its
`packed/` weights, which a start writes into the folder), then a warm run on what the cold one
left. The record
counts the files each run wrote into them (a warm run writes none) and gives the medians of
both kinds side by side; it prints the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from minisgl.benchmark.common import record_header, write_json

CACHE_VARS = ("MINISGL_CACHE_DIR", "MINISGL_KERNEL_CACHE")

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from minisgl import LLM
t1 = time.perf_counter()
llm = LLM(**json.loads(sys.argv[1]))
t2 = time.perf_counter()
print("STARTUP " + json.dumps({"import_s": t1 - t0, "llm_s": t2 - t1}), flush=True)
"""


@dataclass(frozen=True)
class Run:
    kind: str  # cold | warm
    repeat: int
    import_s: float
    llm_s: float
    process_s: float
    cache_files_written: int


def _files(roots: list[Path]) -> set[Path]:
    return {p for r in roots for p in r.rglob("*") if p.is_file()}


def run_once(kind: str, repeat: int, llm_kwargs: dict[str, Any], caches: list[Path]) -> Run:
    """One fresh process building `LLM(**llm_kwargs)` with its caches in `caches`."""
    env = dict(os.environ, **{v: str(c) for v, c in zip(CACHE_VARS, caches, strict=True)})
    before = _files(caches)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(llm_kwargs)], env=env,
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    process_s = time.perf_counter() - t0
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("STARTUP ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{kind} start-up run failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")  # fmt: skip
    phases = json.loads(line.removeprefix("STARTUP "))
    written = len(_files(caches) - before)
    return Run(kind, repeat, phases["import_s"], phases["llm_s"], process_s, written)


def summarize(runs: list[Run]) -> dict[str, dict[str, float]]:
    """Medians of each phase, per kind of run."""
    out: dict[str, dict[str, float]] = {}
    for kind in ("cold", "warm"):
        mine = [r for r in runs if r.kind == kind]
        out[kind] = {
            key: statistics.median(getattr(r, key) for r in mine)
            for key in ("import_s", "llm_s", "process_s", "cache_files_written")
        }
    return out


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minisgl.benchmark.startup")
    p.add_argument("--model-path", default=None, help="default: the embedded model")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="another LLM(...) argument (a JSON value or a string)")  # fmt: skip
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.model_path is not None and not Path(args.model_path).is_dir():
        p.error(f"--model-path {args.model_path}: no such folder")
    llm_kwargs: dict[str, Any] = {"model_path": args.model_path}
    if args.threads is not None:
        llm_kwargs["threads"] = args.threads
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--set takes KEY=VALUE, got {item!r}")
        llm_kwargs[key] = _value(value)
    runs: list[Run] = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="minisgl-startup-") as tmp:
            caches = [Path(tmp) / "models", Path(tmp) / "kernels"]
            for c in caches:
                c.mkdir()
            kwargs = dict(llm_kwargs)
            if args.model_path is not None:  # its packed weights start cold too
                kwargs["model_path"] = str(caches[0] / Path(args.model_path).name)
                shutil.copytree(args.model_path, kwargs["model_path"],
                                ignore=shutil.ignore_patterns("packed"))  # fmt: skip
            runs.append(run_once("cold", i, kwargs, caches))
            runs.append(run_once("warm", i, kwargs, caches))
    summary = summarize(runs)
    ratio = summary["cold"]["process_s"] / summary["warm"]["process_s"]
    record = {
        **record_header("startup", argv),
        "settings": {"llm_kwargs": llm_kwargs, "repeats": args.repeats},
        "runs": [asdict(r) for r in runs],
        "summary": summary,
        "ratios": {"cold_over_warm_process": ratio},
    }
    write_json(args.out, record)
    print(json.dumps({"summary": summary, "ratios": record["ratios"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
