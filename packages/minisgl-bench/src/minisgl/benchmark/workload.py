"""Replay workloads: the JSON file format, its validation, and the synthetic token ids.

A workload is a capacity block and a list of requests (`docs/benchmarks.md#workload-replay`):

    {"capacity": {"num_pages": 64, "page_size": 4, "prefill_budget": 32, "max_running": 4,
                  "max_seq_len": 256, "cache": "radix", "priority_aging_steps": 16},
     "requests": [{"id": "a", "prompt_len": 20, "output_len": 8, "arrival_tick": 0},
                  {"id": "b", "prompt_ids": [5, 6, 7], "output_len": 4, "priority": -1}]}

`max_seq_len` defaults to the longest `prompt + output_len` of the file (every request then
finishes at its `output_len`), `cache` to `radix`, `priority_aging_steps` to 16 (used only
with priority scheduling), `priority` to 0, `arrival_tick` to 0. Top-level `name` and
`description` strings are allowed; any other key is an error. Every error names its field
path and is raised as `WorkloadError` (the Rust `minisgl-cpu-service replay` checks the same
rules in the same order with the same messages).

Synthetic ids (identical in Rust, `minisgl_cpu_core::replay`): with `seed = fnv1a64(id)`
(the UTF-8 bytes of the request id) and `splitmix64` (the standard finalizer, below), the
prompt token at position i of a `prompt_len` request is `1 + splitmix64(seed + 2 * i) %
32000` and the output token at output position k is `1 + splitmix64(seed + 2 * k + 1) %
32000` (all arithmetic mod 2^64). Replay never stops on EOS: a request finishes at its
`output_len`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB = 32000
MASK64 = (1 << 64) - 1
ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,64}")
PRIORITY_BOUND = 1_000_000
DEFAULT_AGING_STEPS = 16

# field -> (lowest, highest) of the int fields
_CAPACITY_INTS = {
    "num_pages": (1, 1 << 20),
    "page_size": (1, 256),
    "prefill_budget": (1, 1 << 20),
    "max_running": (1, 1024),
    "max_seq_len": (2, 1 << 17),
    "priority_aging_steps": (1, 1 << 20),
}
_CAPACITY_KEYS = (*_CAPACITY_INTS, "cache")
_REQUIRED_CAPACITY = ("num_pages", "page_size", "prefill_budget", "max_running")
_REQUEST_KEYS = ("id", "prompt_ids", "prompt_len", "output_len", "priority", "arrival_tick")
_TOP_KEYS = ("name", "description", "capacity", "requests")
_LEN_RANGE = (1, 1 << 16)
_TICK_RANGE = (0, 1 << 32)
_TOKEN_RANGE = (0, (1 << 31) - 1)


class WorkloadError(ValueError):
    """The workload file is not valid; the message starts with the field path."""


@dataclass(frozen=True)
class Capacity:
    num_pages: int
    page_size: int
    prefill_budget: int  # max prefill (extend) tokens per step
    max_running: int
    max_seq_len: int
    cache: str  # "radix" | "naive"
    priority_aging_steps: int


@dataclass(frozen=True)
class WorkloadRequest:
    id: str
    prompt_ids: tuple[int, ...]
    output_len: int
    priority: int
    arrival_tick: int


@dataclass(frozen=True)
class Workload:
    name: str
    capacity: Capacity
    requests: tuple[WorkloadRequest, ...]


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & MASK64
    return h


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def synthetic_prompt(rid: str, n: int) -> list[int]:
    seed = fnv1a64(rid.encode())
    return [1 + splitmix64((seed + 2 * i) & MASK64) % VOCAB for i in range(n)]


def synthetic_token(rid: str, k: int) -> int:
    """The `k`-th output token (from 0) of request `rid`."""
    return 1 + splitmix64((fnv1a64(rid.encode()) + 2 * k + 1) & MASK64) % VOCAB


def _show(v: Any) -> str:
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False)


def _int(v: Any, path: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise WorkloadError(f"{path}: expected an int in [{lo}, {hi}], got {_show(v)}")
    return v


def _object(v: Any, path: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise WorkloadError(f"{path}: expected an object, got {_show(v)}")
    for k in v:
        if k not in keys:
            raise WorkloadError(f"{path}.{k}: unknown field (expected one of {', '.join(keys)})")
    return v


def _required(obj: dict[str, Any], path: str, key: str) -> Any:
    if key not in obj:
        raise WorkloadError(f"{path}.{key}: required field is missing")
    return obj[key]


def parse_workload(data: Any, name: str = "workload") -> Workload:
    """A `Workload` from the decoded JSON, or a `WorkloadError` naming the first bad field."""
    top = _object(data, "workload", _TOP_KEYS)
    for key in ("name", "description"):
        if key in top and not isinstance(top[key], str):
            raise WorkloadError(f"{key}: expected a string, got {_show(top[key])}")
    cap = _object(_required(top, "workload", "capacity"), "capacity", _CAPACITY_KEYS)
    ints: dict[str, int] = {}
    for key, (lo, hi) in _CAPACITY_INTS.items():
        if key in cap:
            ints[key] = _int(cap[key], f"capacity.{key}", lo, hi)
        elif key in _REQUIRED_CAPACITY:
            _required(cap, "capacity", key)
    cache = cap.get("cache", "radix")
    if cache not in ("radix", "naive"):
        raise WorkloadError(f'capacity.cache: expected "radix" or "naive", got {_show(cache)}')
    reqs = _required(top, "workload", "requests")
    if not isinstance(reqs, list) or not reqs:
        raise WorkloadError(f"requests: expected a non-empty list, got {_show(reqs)}")
    out: list[WorkloadRequest] = []
    seen: set[str] = set()
    for i, r in enumerate(reqs):
        out.append(_request(r, f"requests[{i}]", seen))
    max_seq_len = ints.get("max_seq_len") or max(len(r.prompt_ids) + r.output_len for r in out)
    capacity = Capacity(
        ints["num_pages"], ints["page_size"], ints["prefill_budget"], ints["max_running"],
        max_seq_len, cache, ints.get("priority_aging_steps", DEFAULT_AGING_STEPS),
    )  # fmt: skip
    return Workload(top.get("name", name), capacity, tuple(out))


def _request(r: Any, path: str, seen: set[str]) -> WorkloadRequest:
    obj = _object(r, path, _REQUEST_KEYS)
    rid = _required(obj, path, "id")
    if not isinstance(rid, str) or not ID_PATTERN.fullmatch(rid):
        raise WorkloadError(
            f"{path}.id: expected 1 to 64 characters of [A-Za-z0-9._:-], got {_show(rid)}"
        )
    if rid in seen:
        raise WorkloadError(f"{path}.id: duplicate id {_show(rid)}")
    seen.add(rid)
    if ("prompt_ids" in obj) == ("prompt_len" in obj):
        raise WorkloadError(f"{path}: give exactly one of prompt_ids and prompt_len")
    if "prompt_ids" in obj:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not _LEN_RANGE[0] <= len(ids) <= _LEN_RANGE[1]:
            raise WorkloadError(
                f"{path}.prompt_ids: expected a list of {_LEN_RANGE[0]} to {_LEN_RANGE[1]} "
                f"token ids, got {_show(ids)}"
            )
        prompt = tuple(_int(t, f"{path}.prompt_ids[{k}]", *_TOKEN_RANGE) for k, t in
                       enumerate(ids))  # fmt: skip
    else:
        prompt = tuple(synthetic_prompt(rid, _int(obj["prompt_len"], f"{path}.prompt_len",
                                                  *_LEN_RANGE)))  # fmt: skip
    output_len = _int(_required(obj, path, "output_len"), f"{path}.output_len", *_LEN_RANGE)
    priority = _int(obj.get("priority", 0), f"{path}.priority", -PRIORITY_BOUND, PRIORITY_BOUND)
    tick = _int(obj.get("arrival_tick", 0), f"{path}.arrival_tick", *_TICK_RANGE)
    return WorkloadRequest(rid, prompt, output_len, priority, tick)


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload file (`WorkloadError` on any problem)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{p}: cannot read: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{p}: not JSON: {e}") from None
    return parse_workload(data, p.stem)
