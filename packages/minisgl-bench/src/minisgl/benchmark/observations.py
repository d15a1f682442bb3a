"""Per-request observations: what one request of a benchmark run produced and how fast.

One JSON object per line (JSONL), written by the harness with `--observations F.jsonl` and read
by the release gate (`release_gate.py`); vLLM / SGLang result files convert into the same form
(`release_adapters.py`). Fields (seconds, not milliseconds):

    request_id      stable across runs and backends for the same workload: "<profile>-<index>"
    index           the request's position in the workload (adapters join on it)
    repeat          which repeat of the workload (0-based); (request_id, repeat) is unique
    backend         "python", "rust_service", "vllm", ... (the CPU backend for minisgl)
    device          "cpu:<kind>" (cardgate.hardware.cpu_kind), the GPU name, or "sim:<host>"
    model           model name (and version when known)
    output_token_ids / output_text / output_fingerprint   any of them, or none
    workload_fingerprint  what was asked (prompt token ids + max tokens): when both sides
                    carry one for a request id and they differ, the request is not matched
    error           None, or the failure's message
    ttft_s, itl_s (per-token gaps after the first), e2e_s
    prompt_tokens, output_tokens, kv_pages_in_use (peak KV pages used while it ran)
    source          what wrote it: "minisgl-offline", "minisgl-online", "vllm", "sglang"
    replica         the data-parallel replica that served it (0-based), when the server named
                    it (`--dp N`, N > 1); None otherwise (dp=1, offline, other servers)
    replicas        the server's replica count, when it named one (replica < replicas)

A malformed line raises `ObservationError("F.jsonl:12: ...")`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


class ObservationError(ValueError):
    """A malformed observation; the message names the file and line."""


@dataclass(frozen=True)
class Observation:
    request_id: str
    backend: str
    device: str
    model: str
    index: int | None = None
    repeat: int = 0
    output_token_ids: tuple[int, ...] | None = None
    output_text: str | None = None
    output_fingerprint: str | None = None
    workload_fingerprint: str | None = None
    error: str | None = None
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    kv_pages_in_use: int | None = None
    source: str = "minisgl"
    extra: Mapping[str, Any] = field(default_factory=dict)
    replica: int | None = None
    replicas: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("output_token_ids", "itl_s"):
            if out[key] is not None:
                out[key] = list(out[key])
        out["extra"] = dict(self.extra)
        return out


def request_id(profile: str, index: int) -> str:
    """The id of request `index` of a workload: the same for every run and backend."""
    return f"{profile}-{index}"


def workload_fingerprint(prompt_ids: Iterable[int], max_tokens: int) -> str:
    """Identifies a request of a workload: its prompt token ids and its output length."""
    payload = json.dumps([[int(t) for t in prompt_ids], int(max_tokens)])
    return f"workload:{hashlib.sha256(payload.encode()).hexdigest()[:16]}"


def fingerprint(token_ids: Iterable[int] | None = None, text: str | None = None) -> str | None:
    """`tokens:<sha256[:16]>` of the ids, else `text:<...>` of the text, else None."""
    if token_ids is not None:
        payload, kind = json.dumps([int(t) for t in token_ids]), "tokens"
    elif text is not None:
        payload, kind = text, "text"
    else:
        return None
    return f"{kind}:{hashlib.sha256(payload.encode()).hexdigest()[:16]}"


_STR = ("request_id", "backend", "device", "model")
_OPT_STR = ("output_text", "output_fingerprint", "workload_fingerprint", "error")
_OPT_INT = ("index", "prompt_tokens", "output_tokens", "kv_pages_in_use", "replica")
_OPT_FLOAT = ("ttft_s", "e2e_s")
_KNOWN = {f.name for f in fields(Observation)}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _check_scalars(data: dict[str, Any]) -> None:
    """Returns None; raises `ValueError` naming the first unknown field or the first string,
    integer or number field of the wrong type."""
    unknown = sorted(set(data) - _KNOWN)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} (put free-form data under 'extra')")
    for key in _STR:
        if not isinstance(data.get(key), str) or not data[key]:
            raise ValueError(f"{key!r} must be a non-empty string, got {data.get(key)!r}")
    for key in _OPT_STR:
        if data.get(key) is not None and not isinstance(data[key], str):
            raise ValueError(f"{key!r} must be a string or null, got {data[key]!r}")
    for key in _OPT_INT:
        v = data.get(key)
        if v is not None and (not _is_int(v) or v < 0):
            raise ValueError(f"{key!r} must be a non-negative integer or null, got {v!r}")
    for key in _OPT_FLOAT:
        v = data.get(key)
        if v is not None and (not _is_num(v) or v < 0):
            raise ValueError(f"{key!r} must be a non-negative number or null, got {v!r}")


def _check_structured(data: dict[str, Any]) -> None:
    """Returns None; raises `ValueError` naming the first bad one of `replicas` / `replica`,
    `repeat`, `output_token_ids`, `itl_s` and `extra`."""
    replicas = data.get("replicas")
    if replicas is not None and (not _is_int(replicas) or replicas < 1):
        raise ValueError(f"'replicas' must be a positive integer or null, got {replicas!r}")
    replica = data.get("replica")
    if replica is not None and replicas is not None and replica >= replicas:
        raise ValueError(f"'replica' {replica} is not below 'replicas' {replicas}")
    repeat = data.get("repeat", 0)
    if not _is_int(repeat) or repeat < 0:
        raise ValueError(f"'repeat' must be a non-negative integer, got {repeat!r}")
    ids = data.get("output_token_ids")
    if ids is not None and (not isinstance(ids, list) or not all(_is_int(t) for t in ids)):
        raise ValueError("'output_token_ids' must be a list of integers or null")
    itl = data.get("itl_s", [])
    if not isinstance(itl, list) or not all(_is_num(x) and x >= 0 for x in itl):
        raise ValueError("'itl_s' must be a list of non-negative numbers")
    if not isinstance(data.get("extra", {}), dict):
        raise ValueError("'extra' must be an object")


def from_dict(data: Any) -> Observation:
    """Validate one decoded JSON object; raises `ValueError` naming the bad field."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    _check_scalars(data)
    _check_structured(data)
    ids = data.get("output_token_ids")
    return Observation(
        request_id=data["request_id"],
        backend=data["backend"],
        device=data["device"],
        model=data["model"],
        index=data.get("index"),
        repeat=data.get("repeat", 0),
        output_token_ids=tuple(ids) if ids is not None else None,
        output_text=data.get("output_text"),
        output_fingerprint=data.get("output_fingerprint"),
        workload_fingerprint=data.get("workload_fingerprint"),
        error=data.get("error"),
        ttft_s=data.get("ttft_s"),
        itl_s=tuple(float(x) for x in data.get("itl_s", [])),
        e2e_s=data.get("e2e_s"),
        prompt_tokens=data.get("prompt_tokens"),
        output_tokens=data.get("output_tokens"),
        kv_pages_in_use=data.get("kv_pages_in_use"),
        source=str(data.get("source", "minisgl")),
        extra=data.get("extra", {}),
        replica=data.get("replica"),
        replicas=data.get("replicas"),
    )


def parse_jsonl(text: str, where: str) -> list[Observation]:
    """Observations of a JSONL text; blank lines are skipped. `where` names the file."""
    out: list[Observation] = []
    seen: dict[tuple[str, int], int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except ValueError as exc:
            raise ObservationError(f"{where}:{lineno}: not valid JSON: {exc}") from None
        try:
            obs = from_dict(data)
        except ValueError as exc:
            raise ObservationError(f"{where}:{lineno}: {exc}") from None
        key = (obs.request_id, obs.repeat)
        if key in seen:
            raise ObservationError(
                f"{where}:{lineno}: request {obs.request_id!r} repeat {obs.repeat} already "
                f"observed on line {seen[key]}"
            )
        seen[key] = lineno
        out.append(obs)
    return out


def read_jsonl(path: str | Path) -> list[Observation]:
    """Read an observations file; `ObservationError` naming the file and line when malformed."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ObservationError(f"{path}: cannot read: {exc}") from None
    return parse_jsonl(text, str(path))


def write_jsonl(path: str | Path, observations: Iterable[Observation]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for obs in observations:
            fh.write(json.dumps(obs.to_dict(), sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def arm_path(path: str | Path, arm: str) -> Path:
    """`F.jsonl` -> `F.<arm>.jsonl`: one observations file per A/B arm."""
    p = Path(path)
    return p.with_name(f"{p.stem}.{arm}{p.suffix or '.jsonl'}")
