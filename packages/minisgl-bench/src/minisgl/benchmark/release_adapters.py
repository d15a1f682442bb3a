"""Result files of other serving benchmarks -> observations (`observations.Observation`).

Formats followed (per-request lists, all in seconds; summary keys are in milliseconds and
are not used, the gate recomputes its quantiles from the per-request values):

- vLLM: `vllm bench serve --save-result --save-detailed` (vllm/benchmarks/serve.py, vLLM
  0.10-0.11; the older benchmarks/benchmark_serving.py writes the same keys without
  `latencies` / `start_times`). One JSON object: `model_id`, `backend`, `date`, summary keys
  (`completed`, `failed`, `mean_ttft_ms`, `p99_ttft_ms`, ...), and per request `input_lens`,
  `output_lens`, `ttfts`, `itls` (list per request), `latencies` (when present, else
  TTFT + sum of ITLs), `generated_texts`, `errors` ("" on success).
- SGLang: `python -m sglang.bench_serving --output-file F.jsonl --output-details`
  (python/sglang/bench_serving.py, SGLang 0.4-0.5). The file is appended to: one JSON object
  per run (line), with summary keys (`completed`, `mean_e2e_latency_ms`, `p99_ttft_ms`,
  `server_info`, ...) and, with `--output-details`, `input_lens`, `output_lens`, `ttfts`,
  `itls`, `generated_texts`, `errors`. No per-request latency: e2e = TTFT + sum of ITLs.
  Every line of a file is one repeat of the same workload (split a file holding different
  workloads first).

Neither carries request ids: request i gets `request_id = str(i)` and `index = i` (its position
in the benchmark's dataset, which both tools keep in their output lists), so the release gate
joins such a file with another one by index (`--join index`, the default when either side
comes from an adapter). A failed request is an observation with `error` set (its text when the
tool recorded one, else "failed without a message" for an empty output with TTFT 0).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minisgl.benchmark.observations import Observation, ObservationError, parse_jsonl

FORMATS = ("minisgl", "vllm", "sglang")
DETAIL_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


def _documents(text: str, where: str) -> list[tuple[int, Any]]:
    """The JSON documents of a file: one object, or one per line (JSONL)."""
    stripped = text.strip()
    if not stripped:
        raise ObservationError(f"{where}:1: empty file")
    try:
        return [(1, json.loads(stripped))]
    except ValueError:
        pass
    docs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                docs.append((lineno, json.loads(line)))
            except ValueError as exc:
                raise ObservationError(f"{where}:{lineno}: not valid JSON: {exc}") from None
    return docs


def detect_format(path: str | Path) -> str:
    """`minisgl`, `vllm` or `sglang` from the file's keys; ObservationError when ambiguous."""
    where = str(path)
    text = _read(path)
    lineno, first = _documents(text, where)[0]
    if not isinstance(first, dict):
        raise ObservationError(f"{where}:{lineno}: expected a JSON object")
    if "request_id" in first:
        return "minisgl"
    if "ttfts" in first or "completed" in first:
        if "model_id" in first or "endpoint_type" in first:
            return "vllm"
        if "server_info" in first or "total_throughput" in first or "dataset_name" in first:
            return "sglang"
    raise ObservationError(
        f"{where}:{lineno}: cannot tell the format (not minisgl observations, no vLLM "
        "'model_id' / SGLang 'server_info' key); pass --baseline-format / --candidate-format"
    )


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ObservationError(f"{path}: cannot read: {exc}") from None


def _num(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{what} must be a non-negative number, got {value!r}")
    return float(value)


def _run(
    doc: dict[str, Any], where: str, repeat: int, backend: str, model: str, device: str
) -> list[Observation]:
    missing = [k for k in DETAIL_KEYS if k not in doc]
    if missing:
        raise ValueError(
            f"no per-request details {missing} (run {backend}'s benchmark with "
            + ("--save-detailed)" if backend == "vllm" else "--output-details)")
        )
    n = len(doc["ttfts"])
    for key in (*DETAIL_KEYS, *(("latencies",) if "latencies" in doc else ())):
        if not isinstance(doc[key], list) or len(doc[key]) != n:
            raise ValueError(f"{key!r} must be a list of {n} entries (one per request)")
    out = []
    for i in range(n):
        ttft = _num(doc["ttfts"][i], f"ttfts[{i}]")
        raw_itl = doc["itls"][i] or []
        if not isinstance(raw_itl, list):
            raise ValueError(f"itls[{i}] must be a list")
        itl = tuple(_num(x, f"itls[{i}]") for x in raw_itl)
        text = doc["generated_texts"][i]
        if text is not None and not isinstance(text, str):
            raise ValueError(f"generated_texts[{i}] must be a string")
        err = doc["errors"][i]
        error = str(err) if err else None
        n_out = doc["output_lens"][i]
        if error is None and ttft == 0.0 and not text and not n_out:
            error = "failed without a message"
        if "latencies" in doc and doc["latencies"][i] is not None:
            e2e = _num(doc["latencies"][i], f"latencies[{i}]")
        else:
            e2e = ttft + sum(itl)
        failed = error is not None
        out.append(
            Observation(
                request_id=str(i),
                index=i,
                repeat=repeat,
                backend=backend,
                device=device,
                model=model,
                output_text=None if failed else (text or ""),
                error=error,
                ttft_s=None if failed else ttft,
                itl_s=() if failed else itl,
                e2e_s=None if failed else e2e,
                prompt_tokens=_opt_int(doc["input_lens"][i]),
                output_tokens=_opt_int(n_out),
                workload_fingerprint=None
                if failed
                else lengths_fingerprint(_opt_int(doc["input_lens"][i]), _opt_int(n_out)),
                source=backend,
                extra={"file": Path(where).name},
            )
        )
    return out


def lengths_fingerprint(input_len: int | None, output_len: int | None) -> str | None:
    """An external file's workload per request: its (input, output) token lengths (those files
    hold no prompt ids). Compared only with fingerprints of the same kind (`lengths:`)."""
    if input_len is None or output_len is None:
        return None
    return f"lengths:{input_len}:{output_len}"


def _opt_int(v: Any) -> int | None:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 else None


def _load_tool(path: str | Path, backend: str, device: str) -> list[Observation]:
    where = str(path)
    out: list[Observation] = []
    for repeat, (lineno, doc) in enumerate(_documents(_read(path), where)):
        if not isinstance(doc, dict):
            raise ObservationError(f"{where}:{lineno}: expected a JSON object")
        if backend == "vllm":
            model = str(doc.get("model_id") or "unknown")
        else:
            info = doc.get("server_info") or {}
            model = str(info.get("model_path") or doc.get("model") or "unknown")
            model = Path(model).name if "/" in model else model
        try:
            out.extend(_run(doc, where, repeat, backend, model, device))
        except ValueError as exc:
            raise ObservationError(f"{where}:{lineno}: {exc}") from None
    return out


def load_vllm(path: str | Path, device: str = "unknown") -> list[Observation]:
    return _load_tool(path, "vllm", device)


def load_sglang(path: str | Path, device: str = "unknown") -> list[Observation]:
    return _load_tool(path, "sglang", device)


def load_minisgl(path: str | Path, device: str = "unknown") -> list[Observation]:
    return parse_jsonl(_read(path), str(path))


LOADERS: dict[str, Callable[..., list[Observation]]] = {
    "minisgl": load_minisgl,
    "vllm": load_vllm,
    "sglang": load_sglang,
}


def load(path: str | Path, fmt: str = "auto", device: str = "unknown") -> tuple[str, list]:
    """(format, observations) of `path`; `fmt="auto"` detects it."""
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt not in LOADERS:
        raise ObservationError(f"{path}: unknown format {fmt!r} (choose from {FORMATS})")
    return fmt, LOADERS[fmt](path, device=device)
