"""What this CPU can do, from /proc/cpuinfo (empty where it cannot be read), and the switch
that makes a CPU with more look like one with less (`MINISGL_CPU_ISA`).

The machines this runs on are of two x86 kinds: Intel Xeons with AMX (BF16 and INT8 tiles) and
AMD EPYCs with AVX-512 (BF16, VNNI) and no AMX; laptops and older servers have AVX2 only. Each
kind takes its own code paths (AMX tiles or VNNI kernels in oneDNN and in `kernels/cpu`'s C;
u8 or s8 activations in W8A8; AVX-512 or plain loops in the C kernels). `MINISGL_CPU_ISA` caps
the features every path sees, so each path runs (and is tested) on the richer machine too:

- `native` (default): what the CPU has;
- `avx512`: no AMX (an AMD EPYC's paths on an AMX Xeon);
- `avx2`: no AMX and no AVX-512 (the C kernels' plain loops, oneDNN's AVX2 kernels).

It is read once per process: the C kernels are built for it (`march_flags`) and oneDNN is
capped with it (`ONEDNN_MAX_CPU_ISA`, set on import of `minisgl` when not set already).
"""

from __future__ import annotations

import functools
import os

ISA_LEVELS = ("native", "avx512", "avx2")
# flags a level removes (prefixes): what the CPU would lack
_MASKED = {
    "native": (),
    "avx512": ("amx",),
    "avx2": ("amx", "avx512", "avx_vnni"),
}
# gcc flags that keep the C kernels to a level (`-march=native` otherwise enables everything)
_MARCH = {
    "native": (),
    "avx512": ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"),
    "avx2": ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16", "-mno-avx512f", "-mno-avxvnni"),
}
# oneDNN's cap for a level (its `ONEDNN_MAX_CPU_ISA` names)
ONEDNN_ISA = {"avx512": "AVX512_CORE_BF16", "avx2": "AVX2"}


@functools.cache
def isa_level() -> str:
    """`MINISGL_CPU_ISA` (native when unset); ValueError on an unknown level."""
    level = os.environ.get("MINISGL_CPU_ISA", "native").strip().lower() or "native"
    if level not in ISA_LEVELS:
        raise ValueError(f"MINISGL_CPU_ISA must be one of {', '.join(ISA_LEVELS)}, got {level!r}")
    return level


@functools.cache
def native_flags() -> frozenset[str]:
    """The first processor's feature flags as /proc/cpuinfo lists them."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags (`avx512_bf16`, `amx_int8`, ...) the code paths may use: the CPU's,
    less what `MINISGL_CPU_ISA` masks."""
    masked = _MASKED[isa_level()]
    return frozenset(f for f in native_flags() if not f.startswith(masked))


def native_bf16() -> bool:
    """Whether bf16 GEMMs run natively (AVX512-BF16 or AMX-BF16 under the level); without,
    oneDNN emulates them: 46 ms for a [500, 576] x [576, 3072] linear on an AMD EPYC with AVX2
    only, 2 threads, where the same GEMM in fp32 is a few ms."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def amx_tiles() -> bool:
    """Whether AMX tiles may be used: the CPU has them, the level allows them, and Linux
    grants the tile state (torch's check)."""
    import torch

    return "amx_tile" in cpu_flags() and bool(torch.cpu._is_amx_tile_supported())


def march_flags() -> tuple[str, ...]:
    """gcc flags after `-march=native` that keep generated code to the level."""
    return _MARCH[isa_level()]


def isa_summary() -> dict[str, object]:
    """What benchmark records say of the CPU's features: the level in force, the features the
    code paths choose by that the CPU has, and those they may use under the level (the
    machine's kind is cardgate's `hardware.cpu_kind`, which the gates are keyed by)."""
    keys = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
    return {
        "isa_level": isa_level(),
        "features": sorted(k for k in keys if k in native_flags()),
        "features_used": sorted(k for k in keys if k in cpu_flags()),
    }
