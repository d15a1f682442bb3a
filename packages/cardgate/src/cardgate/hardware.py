"""What the tests ran on: CPU model, GPU name/driver/CUDA, library versions (no heavy imports).

`CARDGATE_GPU=0` forces "no GPU" (for CPU-only runs and tests on GPU machines); `=1` trusts
that a device exists, and the gate refuses it where the kernel driver shows no GPU
(`forced_gpu_problem`). Otherwise torch is consulted lazily: only when a `gpu` test runs, and a
missing torch counts as no GPU. The GPU name gates are keyed by needs two sources that agree:
the kernel driver (`/proc/driver/nvidia`, never a program on `PATH`) and torch's device (torch
is imported for it only where the driver shows a GPU); a fake torch on a CPU machine, or a
driver torch cannot use, is the CPU kind. The manifest records the sources
(`hardware_source`: "torch+driver" or "none").
"""

from __future__ import annotations

import functools
import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path
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


DRIVER_GPUS = "/proc/driver/nvidia/gpus"
DRIVER_VERSION = "/proc/driver/nvidia/version"


def _driver() -> dict[str, str]:
    """GPU name and driver version from the kernel driver's own files (`/proc/driver/nvidia`):
    not a program found on PATH, which anyone can shadow."""
    names: list[str] = []
    base = Path(DRIVER_GPUS)
    try:
        for info in sorted(base.glob("*/information")):
            for line in info.read_text(encoding="utf-8", errors="replace").splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "Model" and value.strip():
                    names.append(value.strip())
    except OSError:
        return {}
    if not names:
        return {}
    found = {"gpu_name": names[0], "gpu_count": str(len(names)), "source": "driver"}
    try:
        banner = Path(DRIVER_VERSION).read_text(encoding="utf-8", errors="replace")
    except OSError:
        banner = ""
    match = re.search(r"Kernel Module\s+([\d.]+)", banner)
    if match:
        found["gpu_driver"] = match.group(1)
    return found


def _torch_device_name() -> str | None:
    """torch's name for device 0, or None (no torch, or no device it can use)."""
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except Exception:
            return None
    try:
        if torch.cuda.is_available():
            return str(torch.cuda.get_device_name(0))
    except Exception:
        return None
    return None


def gpu_info() -> dict[str, str]:
    """GPU name/driver when the kernel driver shows a GPU and torch sees the same device; {}
    on CPU-only machines, with CARDGATE_GPU=0, or when the two disagree."""
    if _forced() is False:
        return {}
    driver = _driver()
    if not driver:
        return {}
    name = _torch_device_name()
    if name is None or name != driver["gpu_name"]:
        return {}
    info = {**driver, "source": "torch+driver"}
    version = getattr(getattr(sys.modules.get("torch"), "version", None), "cuda", None)
    if version:
        info["torch_cuda"] = str(version)
    return info


def forced_gpu_problem() -> str | None:
    """Why `CARDGATE_GPU=1` cannot be trusted here (None when it is not set or a driver shows a
    GPU): gpu tests would run on the CPU and count as GPU evidence."""
    if _forced() is not True or _driver():
        return None
    return (
        f"{GPU_ENV}=1 but the kernel driver shows no GPU ({DRIVER_GPUS}): gpu tests would run "
        f"on the CPU; unset {GPU_ENV} (or set it to 0)"
    )


def hardware_source(info: dict[str, str]) -> str:
    """How the hardware key was found: "torch", "driver" or "none" (no GPU: the CPU kind)."""
    return info.get("source", "none")


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
        "hardware_source": hardware_source(gpu),
        "gpu": gpu or None,
        "versions": {
            name: version_of(name)
            for name in ("torch", "transformers", "pytest", "pytest-xdist", "pytest-cardgate")
        },
    }
