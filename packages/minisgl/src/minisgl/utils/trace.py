"""Request timelines across the server's processes (`MINISGL_TRACE_DIR`; off by default).

Each process appends `(stage, uid, t)` rows to a buffer, `t` being `time.perf_counter()`
(CLOCK_MONOTONIC on Linux: one clock for every process of the machine), and writes them to
`<dir>/trace-<run>-<pid>.jsonl` every second and at exit (`run`: the launcher's pid, shared by
its workers, so servers started one after another keep their uids apart). `minisgl.benchmark.trace` joins
the files into per-request stage gaps (where the time to the first token goes). When the
variable is unset, `mark` is one global test.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

ENV = "MINISGL_TRACE_DIR"
RUN_ENV = "MINISGL_TRACE_RUN"  # one server's processes share it (uids restart with a server)
FLUSH_ROWS = 4096

_dir = os.environ.get(ENV) or None
FLUSH_S = 1.0
_rows: list[tuple[str, int, float]] = []
_lock = threading.Lock()
_flushed = time.perf_counter()


def enabled() -> bool:
    return _dir is not None


def mark(stage: str, uids: Iterable[int] | int, t: float | None = None) -> None:
    """Record that `uids` passed `stage` (now, or at `t`)."""
    if _dir is None:
        return
    now = time.perf_counter() if t is None else t
    if isinstance(uids, int):
        batch = [(stage, uids, now)]
    else:
        batch = [(stage, int(u), now) for u in uids]
    with _lock:
        _rows.extend(batch)
        due = len(_rows) >= FLUSH_ROWS or now - _flushed > FLUSH_S
    if due:
        flush()


def start_run() -> None:
    """Name this process's server run (the launcher, before it starts its workers)."""
    if _dir is not None:
        os.environ.setdefault(RUN_ENV, str(os.getpid()))


def flush() -> None:
    global _flushed
    if _dir is None:
        return
    with _lock:
        _flushed = time.perf_counter()
        rows = _rows[:]
        _rows.clear()
    if not rows:
        return
    run = os.environ.get(RUN_ENV) or str(os.getpid())
    path = Path(_dir) / f"trace-{run}-{os.getpid()}.jsonl"
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if _dir is not None:
    Path(_dir).mkdir(parents=True, exist_ok=True)
    atexit.register(flush)
