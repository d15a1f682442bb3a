"""CPU backend environment and path counters (a leaf module: no other scheduler imports).

Environment (read by `minisgl.scheduler.factory.make_scheduler`):
- `MINISGL_CPU_BACKEND=python|<registered name>` (default `python`); the server also takes
  `rust_service` (`minisgl.cpu_service`: no scheduler in this process at all). Tests and
  benchmarks register the in-process Rust core as `rust_hotpath`
  (`minisgl.testing.rust_hotpath`); the runtime never loads that extension.
- `MINISGL_CPU_BACKEND_SHADOW=1`: run another registered backend beside the primary on every
  decision (none in the runtime alone: then the primary serves unshadowed, a logged fallback)
  and write divergences as JSON lines to `MINISGL_CPU_BACKEND_SHADOW_REPORT` (at most
  `MINISGL_CPU_BACKEND_SHADOW_MAX_DIFFS`, default 1000). Serving always uses the primary.

If a registered backend's extension is missing or raises while building it, the Python
scheduler serves instead: one log line, and the fallback is counted. If a Rust call raises
mid-run while a Python shadow is present, that call and every later one are served by the
Python shadow (its state is the reference). `stats()` returns the counters.
"""

from __future__ import annotations

import os
import threading
from collections import Counter, defaultdict
from typing import Any

from minisgl.utils.log import get_logger

logger = get_logger(__name__)

BACKENDS = ("python",)  # built in; `factory.available_backends()` lists all registered
ALIASES = {"rust-service": "rust_service"}
SERVICE = "rust_service"  # not a scheduler: the server runs the Rust service process instead
ENV_BACKEND = "MINISGL_CPU_BACKEND"
ENV_SHADOW = "MINISGL_CPU_BACKEND_SHADOW"
ENV_SHADOW_REPORT = "MINISGL_CPU_BACKEND_SHADOW_REPORT"
ENV_SHADOW_MAX = "MINISGL_CPU_BACKEND_SHADOW_MAX_DIFFS"

_lock = threading.Lock()
_served: defaultdict[str, Counter] = defaultdict(Counter, {b: Counter() for b in BACKENDS})
_fallbacks: Counter = Counter()
_shadow: Counter = Counter()
_logged: set[str] = set()


def served_counter(backend: str) -> Counter:
    """The live counter of calls served by `backend` (schedule / commit ...)."""
    return _served[backend]


def count_shadow(key: str, n: int = 1) -> None:
    _shadow[key] += n


def record_fallback(reason: str, exc: BaseException | None = None) -> None:
    with _lock:
        _fallbacks[reason] += 1
        first = reason not in _logged
        _logged.add(reason)
    if first:
        logger.warning("minisgl cpu backend: falling back to python (%s): %r", reason, exc)


def stats() -> dict[str, Any]:
    """Counters of which backend served each call, fallbacks and shadow comparisons."""
    return {
        "requested": requested_backend(),
        "served": {b: dict(c) for b, c in _served.items()},
        "fallbacks": sum(_fallbacks.values()),
        "fallback_reasons": dict(_fallbacks),
        "shadow": dict(_shadow),
    }


def reset_stats() -> None:
    for c in (*_served.values(), _fallbacks, _shadow):
        c.clear()
    _logged.clear()


def requested_backend(explicit: str | None = None) -> str:
    """The backend name asked for (`explicit`, else `MINISGL_CPU_BACKEND`, else `python`),
    normalized; the factory checks it against its registry."""
    name = (explicit or os.environ.get(ENV_BACKEND) or "python").strip().lower()
    return ALIASES.get(name, name)


def shadow_enabled() -> bool:
    return os.environ.get(ENV_SHADOW, "").strip().lower() in ("1", "true", "yes", "on")
