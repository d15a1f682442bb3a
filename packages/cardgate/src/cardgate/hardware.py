"""What the tests ran on: CPU model, GPU name/driver/CUDA, library versions (no heavy imports).

`CARDGATE_GPU=0` forces "no GPU" (for CPU-only runs and tests on GPU machines); `=1` trusts
that a device exists. Otherwise torch is consulted lazily: only when a `gpu` test runs, and a
missing torch counts as no GPU.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from typing import Any

GPU_ENV = "CARDGATE_GPU"


def _forced() -> bool | None:
    raw = os.environ.get(GPU_ENV, "").strip().lower()
    if raw in {"0", "false", "no", "off"}:
        return False
    if raw in {"1", "true", "yes", "on"}:
        return True
    return None


def cuda_available() -> bool:
    """True when torch sees a CUDA device (imports torch on first call; no torch = no GPU)."""
    forced = _forced()
    return _torch_cuda() if forced is None else forced


@functools.cache
def _torch_cuda() -> bool:
    try:
        import torch
    except Exception:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _nvidia_smi() -> dict[str, str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        query = subprocess.run(
            [exe, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        banner = subprocess.run([exe], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    first = query.strip().splitlines()[0] if query.strip() else ""
    name, _, driver = first.partition(",")
    info = {"gpu_name": name.strip(), "gpu_driver": driver.strip()}
    match = re.search(r"CUDA Version:\s*([\d.]+)", banner)
    if match:
        info["cuda_driver_version"] = match.group(1)
    return {k: v for k, v in info.items() if v}


def gpu_info() -> dict[str, str]:
    """GPU name/driver/CUDA when present; {} on CPU-only machines or with CARDGATE_GPU=0."""
    if _forced() is False:
        return {}
    info = _nvidia_smi()
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                info.setdefault("gpu_name", torch.cuda.get_device_name(0))
                if torch.version.cuda:
                    info["torch_cuda"] = str(torch.version.cuda)
        except Exception:
            pass
    return info


CPU_KINDS = ("intel-amx", "amd-epyc", "x86-avx512", "x86-avx2")


def cpu_kind(cpuinfo: str | None = None) -> str:
    """The kind of CPU a number was measured on, from /proc/cpuinfo's vendor and flags:
    `intel-amx` (AMX tiles), `amd-epyc` (an AMD CPU with AVX-512), `x86-avx512`, `x86-avx2`,
    else the machine name. The same code runs different kernels on each (AMX tiles, VNNI,
    plain AVX2), so a speed gated on one kind says nothing of another."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as handle:
                cpuinfo = handle.read(1 << 16)
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    if "amx_tile" in flags:
        return "intel-amx"
    if "avx512f" in flags:
        return "amd-epyc" if fields.get("vendor_id") == "AuthenticAMD" else "x86-avx512"
    if "avx2" in flags:
        return "x86-avx2"
    return platform.machine().lower() or "unknown"


def hardware_key(info: dict[str, str] | None = None) -> str:
    """The hardware string gates are keyed by: the GPU name, or "cpu:<kind>" (`cpu_kind`)."""
    info = gpu_info() if info is None else info
    return info.get("gpu_name") or f"cpu:{cpu_kind()}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version_of(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def describe() -> dict[str, Any]:
    """Machine facts for a manifest: nothing that names a user, host or absolute path."""
    gpu = gpu_info()
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "cpu_model": cpu_model(),
        "cpu_kind": cpu_kind(),
        "cpu_count": os.cpu_count(),
        "hardware": hardware_key(gpu),
        "gpu": gpu or None,
        "versions": {
            name: version_of(name)
            for name in ("torch", "transformers", "pytest", "pytest-xdist", "pytest-cardgate")
        },
    }
