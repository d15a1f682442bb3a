"""The llama.cpp arm: llama-cpp-python on the GGUF file the embedded model ships.

Opt-in (`pip install minisgl[llamacpp]` built from source with native CPU flags, or
`nox -s llamacpp`): never part of the default test run. The adapter needs only the
`Llama.generate` / `Llama.eval` / `Llama.scores` surface, so the unit test drives it with a fake.

llama.cpp's Python API runs one sequence at a time: a workload's requests run back to back in
arrival order (all offline, like the HF arm), each greedy (temperature 0, no penalties) for
exactly its `max_tokens` (EOS ignored, as in the minisgl arm). The prompt goes in as token ids,
so the three engines see the same tokens.

`cpu_speed` runs the arm in a process of its own (`peers.PEERS["llamacpp"]`, entry `open_peer`),
on the first of its `PATHS` that works: `default`, then `no_extra_bufts` (the model parameter
`use_extra_bufts = False`: no "extra buffer types", the repacked weights llama.cpp's AMX path
uses; built with native flags on an Intel AMX Xeon, 0.3.36's default segfaults in `decode` on
the embedded Q4_1 GGUF).
"""

from __future__ import annotations

import contextlib
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


# the ways to open the model, in the order `cpu_speed` tries them
PATHS = ("default", "no_extra_bufts")


class LlamaCppUnavailable(RuntimeError):
    """llama-cpp-python is not installed in this interpreter."""


class ExtraBuftsUnsupported(RuntimeError):
    """The installed llama-cpp-python's `llama_model_params` has no `use_extra_bufts` field."""


def load_llamacpp(
    gguf: str | Path,
    threads: int,
    n_ctx: int = 2048,
    logits_all: bool = False,
    extra_bufts: bool = True,
) -> Any:
    """A `llama_cpp.Llama` on `gguf` with `threads` threads for decode and prefill;
    `extra_bufts=False` loads it with the model parameter `use_extra_bufts = False`."""
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppUnavailable(
            f"the llama.cpp arm needs llama-cpp-python: {INSTALL_HINT}"
        ) from None
    with contextlib.nullcontext() if extra_bufts else without_extra_bufts(llama_cpp):
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


@contextlib.contextmanager
def without_extra_bufts(llama_cpp: Any) -> Iterator[None]:
    """Models loaded inside get `use_extra_bufts = False`: `Llama.__init__` starts from the
    ctypes bindings' `llama_model_default_params()` (module `llama_cpp.llama_cpp`) and has no
    argument for the field, so the function is wrapped for the while."""
    bindings = getattr(llama_cpp, "llama_cpp", None)
    fields = {f[0] for f in getattr(getattr(bindings, "llama_model_params", None), "_fields_", ())}
    if "use_extra_bufts" not in fields:
        version = getattr(llama_cpp, "__version__", "?")
        raise ExtraBuftsUnsupported(
            f"llama-cpp-python {version}: llama_model_params has no use_extra_bufts field"
        )
    defaults = bindings.llama_model_default_params

    def without() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = without
    try:
        yield
    finally:
        bindings.llama_model_default_params = defaults


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
    """Greedy continuation of `prompt`, exactly `max_tokens` tokens, yielded as they come, from
    an empty context: `generate(reset=True)` alone still skips the longest common prefix with
    the tokens the model evaluated last, and the benchmark's passes repeat their prompts (a
    timed single-stream pass then skipped llama.cpp's prefill, while minisgl's arm flushes its
    prefix cache before each pass)."""
    if max_tokens <= 0:
        return
    model.reset()
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


class LlamaCppPeer:
    """The arm as a peer of `cpu_speed` (`peers.PeerSpec`'s entry protocol), in its own
    process: the model loaded on `path`, a scorer for perplexity loaded when first asked."""

    def __init__(self, path: str, gguf: str, threads: int, n_ctx: int = 2048) -> None:
        if path not in PATHS:
            raise ValueError(f"unknown llama.cpp path {path!r}; expected one of {PATHS}")
        self.gguf, self.threads, self.extra_bufts = gguf, threads, path == "default"
        self.model = load_llamacpp(gguf, threads, n_ctx=n_ctx, extra_bufts=self.extra_bufts)

    def info(self) -> dict[str, Any]:
        return {**llamacpp_info(), "use_extra_bufts": self.extra_bufts}

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
        return [generate(self.model, p, max_tokens) for p in prompts]

    def perplexity(self, ids: Sequence[int]) -> float:
        scorer = load_llamacpp(
            self.gguf, self.threads, n_ctx=512, logits_all=True, extra_bufts=self.extra_bufts
        )
        return perplexity(scorer, ids)

    def run(self, items: Sequence[WorkItem]) -> dict[str, Any]:
        return run_llamacpp(self.model, items)["metrics"]


def open_peer(path: str, **options: Any) -> LlamaCppPeer:
    """`peers.PEERS["llamacpp"]`'s entry: options `gguf`, `threads`, `n_ctx`."""
    return LlamaCppPeer(path, **options)
