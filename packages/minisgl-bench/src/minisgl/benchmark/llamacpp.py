"""The llama.cpp arm: llama-cpp-python on the GGUF file the embedded model ships.

Opt-in (`pip install minisgl[llamacpp]` built from source with native CPU flags, or
`nox -s llamacpp`): never part of the default test run. The adapter needs only the
`Llama.generate` / `Llama.eval` / `Llama.scores` surface, so the unit test drives it with a fake.

llama.cpp's Python API runs one sequence at a time: a workload's requests run back to back in
arrival order (all offline, like the HF arm), each greedy (temperature 0, no penalties) for
exactly its `max_tokens` (EOS ignored, as in the minisgl arm). The prompt goes in as token ids,
so the three engines see the same tokens.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from minisgl.benchmark.common import CpuMeter
from minisgl.benchmark.offline import Progress, add_cpu_efficiency, request_metrics
from minisgl.benchmark.profiles import WorkItem

INSTALL_HINT = (
    'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python '
    '"minisgl[llamacpp]"  (or: nox -s llamacpp)'
)
# greedy: llama-cpp-python samples with a greedy sampler at temp == 0; the rest neutralised
GREEDY = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}


class LlamaCppUnavailable(RuntimeError):
    """llama-cpp-python is not installed in this interpreter."""


def load_llamacpp(
    gguf: str | Path, threads: int, n_ctx: int = 2048, logits_all: bool = False
) -> Any:
    """A `llama_cpp.Llama` on `gguf` with `threads` threads for decode and prefill."""
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppUnavailable(
            f"the llama.cpp arm needs llama-cpp-python: {INSTALL_HINT}"
        ) from None
    return llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        seed=0,
        verbose=False,
    )


def llamacpp_info() -> dict[str, Any]:
    """Version and build flags of the installed llama-cpp-python (`{}` when absent)."""
    try:
        import llama_cpp
    except ImportError:
        return {}
    info: dict[str, Any] = {"version": getattr(llama_cpp, "__version__", "?")}
    system_info = getattr(llama_cpp, "llama_print_system_info", None)
    if callable(system_info):
        raw = system_info()
        info["system_info"] = raw.decode() if isinstance(raw, bytes) else str(raw)
    return info


def greedy_stream(model: Any, prompt: Sequence[int], max_tokens: int) -> Iterator[int]:
    """Greedy continuation of `prompt`, exactly `max_tokens` tokens, yielded as they come."""
    if max_tokens <= 0:
        return
    gen = model.generate(list(prompt), reset=True, **GREEDY)
    try:
        for n, tok in enumerate(gen, 1):
            yield int(tok)
            if n == max_tokens:
                return
    finally:
        gen.close()


def generate(model: Any, prompt: Sequence[int], max_tokens: int) -> list[int]:
    return list(greedy_stream(model, prompt, max_tokens))


def run_llamacpp(
    model: Any, items: Sequence[WorkItem], progress: Progress | None = None
) -> dict[str, Any]:
    """Every request of `items`, one after another; metrics as `offline.run_minisgl`'s."""
    order = sorted(range(len(items)), key=lambda i: items[i].arrival_s)
    token_times: list[list[float]] = [[] for _ in items]
    out_tokens = [0] * len(items)
    meter = CpuMeter()
    with meter:
        t0 = time.perf_counter()
        for i in order:
            item = items[i]
            for _tok in greedy_stream(model, item.prompt_ids, item.max_tokens):
                token_times[i].append(time.perf_counter() - t0)
                out_tokens[i] += 1
            if progress:
                progress(1)
        duration = time.perf_counter() - t0
    offline = [dataclasses.replace(it, arrival_s=0.0) for it in items]  # all at t=0
    metrics = request_metrics(offline, token_times, out_tokens, duration)
    metrics["cpu"] = meter.result
    add_cpu_efficiency(metrics)
    return {"metrics": metrics, "token_times": token_times}


def perplexity(model: Any, ids: Sequence[int]) -> float:
    """Perplexity of `ids` from one evaluation of all positions (needs `logits_all=True`)."""
    import numpy as np

    model.reset()
    model.eval(list(ids))
    logits = np.asarray(model.scores[: len(ids) - 1], dtype=np.float64)
    top = logits.max(axis=-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
    target = logits[np.arange(len(ids) - 1), np.asarray(ids[1:])]
    return math.exp(float((logz - target).mean()))
