"""Keep freed heap memory for reuse in a CPU engine's process (glibc's malloc).

A CPU step allocates and frees tens of MB of activations (a 4096-token prefill step of the
embedded model: 25 MB for one gate/up output). With glibc's defaults the freed top of the heap
goes back to the kernel (the trim threshold follows the largest chunk freed) and the next step
faults the same pages in again, zero-filled: 50-250 thousand minor faults in a many-short run
of 2 s here. A fixed trim threshold of 2 GB keeps them, as tcmalloc or jemalloc would; chunks
up to 32 MB (glibc's ceiling for the mmap threshold) come from the heap, larger ones (the KV
pool, weights) still from mmap. The cost: the process keeps up to 2 GB of freed heap mapped.
`MINISGL_MALLOC_TUNING=0` leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

from minisgl.utils.log import get_logger

logger = get_logger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2)


@functools.cache
def keep_freed_memory() -> bool:
    """Set the trim and mmap thresholds once for the process; False where malloc is not
    glibc's or `MINISGL_MALLOC_TUNING=0`."""
    if os.environ.get("MINISGL_MALLOC_TUNING", "1") == "0" or platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has no mallopt thresholds)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logger.warning("mallopt refused the trim / mmap thresholds: freed memory is trimmed")
    return ok
