"""What this CPU can do, from /proc/cpuinfo (empty where it cannot be read)."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first processor's feature flags (`avx512_bf16`, `amx_int8`, ...)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()
