"""Shared pieces of the benchmark tools: run metadata (git, machine, env), A/B order, percentiles,
JSON."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

# One definition of the hardware string gate rules match on ("cpu:<kind>" or the GPU name), shared with
# the card gate: the benchmark package already depends on cardgate for its gates format.
from cardgate.hardware import cpu_kind, hardware_key
from cardgate.redact import redact
from minisgl.utils.cpu import isa_summary

SCHEMA_VERSION = 1
ENV_PREFIXES = ("MINISGL_", "OMP_", "MKL_", "TORCH_", "CUDA_VISIBLE_DEVICES", "CARDGATE_")

T = TypeVar("T")


def git_commit(cwd: str | Path | None = None) -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info() -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        import torch

        if torch.cuda.is_available():
            info["name"] = torch.cuda.get_device_name(0)
            info["count"] = torch.cuda.device_count()
            info["cuda"] = torch.version.cuda
    except Exception:
        pass
    exe = shutil.which("nvidia-smi")
    if exe and info:
        try:
            out = subprocess.run(
                [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout.strip()
            info["driver"] = out.splitlines()[0] if out else None
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def machine_info() -> dict[str, Any]:
    import psutil

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_count_logical": psutil.cpu_count(),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpu": gpu_info() or None,
        "hardware": hardware_key(),
        "cpu_kind": cpu_kind(),  # the kernels differ by kind: AMX tiles, VNNI, AVX2
        "isa": isa_summary(),  # the features the code paths chose by (MINISGL_CPU_ISA)
    }
    with contextlib.suppress(OSError):
        info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except Exception:
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:
        pass
    return info


def backend_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    env.setdefault("MINISGL_CPU_BACKEND", os.environ.get("MINISGL_CPU_BACKEND", "python"))
    return dict(sorted(env.items()))


def percentiles(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """p50/p95/p99/mean/max of `values` times `scale` (linear interpolation); None when empty."""
    if not values:
        return {"p50": None, "p95": None, "p99": None, "mean": None, "max": None}
    xs = sorted(float(v) * scale for v in values)
    return {
        "p50": quantile(xs, 0.50),
        "p95": quantile(xs, 0.95),
        "p99": quantile(xs, 0.99),
        "mean": sum(xs) / len(xs),
        "max": xs[-1],
    }


def quantile(values: Sequence[float], q: float) -> float | None:
    """The `q` quantile (0..1) of `values`, linear interpolation; None when empty."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def abba_order(arms: Sequence[T], round_: int) -> list[T]:
    """The arms' order in repeat round `round_` of an A/B run: as given in even rounds, reversed
    in odd ones (A B C, C B A, ...), so a linear drift of the machine's speed falls on every
    arm alike."""
    return list(arms) if round_ % 2 == 0 else list(arms)[::-1]


def median(values: Iterable[float]) -> float | None:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Nested dict of numbers -> {"a.b.c": value} (bools and non-numbers dropped)."""
    out: dict[str, float] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        elif (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ):
            out[name] = float(value)
    return out


def checkout_root(start: Path | None = None) -> Path | None:
    """The git checkout holding `start` (default: the working directory), or None."""
    here = (start or Path.cwd()).resolve()
    return next((d for d in (here, *here.parents) if (d / ".git").exists()), None)


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    """`data` as JSON at `path`, its local absolute paths made repo-relative or placeholders
    (cardgate's redaction: the checkout as `.`, the temporary directory as `<tmp>`, ...)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    text = json.dumps(data, indent=2, sort_keys=False, default=str)
    tmp.write_text(redact(text, checkout_root()) + "\n")
    tmp.replace(path)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def record_header(kind: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What every benchmark record starts with: schema, kind, time, command line (`argv`, else
    this process's), the commit and the machine (its CPU kind and ISA, its GPU)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "created": now_iso(),
        "argv": list(sys.argv[1:] if argv is None else argv),
        "git": git_commit(),
        "machine": machine_info(),
    }


class CpuMeter:
    """CPU seconds of this process (and optionally other pids) over a window, as % of one core."""

    def __init__(self, pids: Sequence[int] = ()) -> None:
        import psutil

        self._procs = {"self": psutil.Process()}
        for pid in pids:  # a server pid counts with all its children (scheduler, tokenizers)
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                for p in [proc, *proc.children(recursive=True)]:
                    self._procs[f"pid{p.pid}"] = p
        self._start: dict[str, float] = {}
        self._t0 = 0.0

    @staticmethod
    def _cpu(proc) -> float | None:
        try:
            t = proc.cpu_times()
        except Exception:
            return None
        return t.user + t.system

    def _cpu_of(self, key: str, proc) -> float | None:
        """CPU seconds so far: this process's from the clock (`process_time`: nanoseconds), the
        others' from the kernel (10 ms ticks: a short window of a light process reads 0)."""
        return time.process_time() if key == "self" else self._cpu(proc)

    def __enter__(self) -> CpuMeter:
        import psutil

        psutil.cpu_percent(None)
        self._t0 = time.perf_counter()
        self._start = {k: self._cpu_of(k, p) for k, p in self._procs.items()}
        return self

    def __exit__(self, *exc: object) -> None:
        import psutil

        wall = max(time.perf_counter() - self._t0, 1e-9)
        self.result: dict[str, Any] = {"wall_s": wall}
        server = 0.0
        for key, proc in self._procs.items():
            start, end = self._start.get(key), self._cpu_of(key, proc)
            if start is not None and end is not None:
                name = "client" if key == "self" else key
                self.result[f"{name}_cpu_pct"] = 100.0 * (end - start) / wall
                if key == "self":
                    self.result["client_cpu_s"] = end - start
                if key != "self":
                    server += self.result[f"{name}_cpu_pct"]
        if len(self._procs) > 1:
            self.result["server_cpu_pct"] = server
        self.result["system_cpu_pct"] = psutil.cpu_percent(None)
        with contextlib.suppress(OSError):
            self.result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]


def ratios(base: dict[str, Any], other: dict[str, Any], keys: Iterable[str]) -> dict[str, float]:
    """other / base for each of `keys` (dotted paths) present in both, base non-zero."""
    fa, fb = flatten(base), flatten(other)
    return {k: fb[k] / fa[k] for k in keys if k in fa and k in fb and fa[k]}


def paired_ratios(
    base_reps: list[dict[str, Any]], reps: list[dict[str, Any]], keys: Iterable[str]
) -> dict[str, Any]:
    """Median over repeats of other / base measured in the same repeat (robust to slow drifts
    in load), and the per-repeat ratios (`<key>_per_repeat`)."""
    out: dict[str, Any] = {}
    for key in keys:
        rs = []
        for a, b in zip(base_reps, reps, strict=False):
            fa, fb = flatten(a), flatten(b)
            if fa.get(key) and fb.get(key):
                rs.append(fb[key] / fa[key])
        if rs:
            out[key] = median(rs)
            out[f"{key}_per_repeat"] = rs
    return out
