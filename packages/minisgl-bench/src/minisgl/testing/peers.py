"""Fake peers of `cpu_speed` (entries for `minisgl.benchmark.peers.PeerSpec`): a peer that
generates like llama.cpp's adapter, and crashes the way a native library does (SIGSEGV, abort,
a bare exit) on the paths and in the calls a test names. They run in the peer's own process."""

from __future__ import annotations

import os
import resource
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from minisgl.benchmark import llamacpp
from minisgl.benchmark.profiles import WorkItem

VOCAB = 384


def die(how: str) -> None:
    """End this process as a native crash would: `segv` (SIGSEGV), `abort` (SIGABRT) or
    `exit:N` (exit status N, no Python clean-up)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    if how == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif how == "abort":
        os.abort()
    elif how.startswith("exit:"):
        os._exit(int(how.split(":", 1)[1]))
    raise ValueError(f"unknown way to crash: {how!r}")


def counting_continuation(_model_path: str, prompt: Sequence[int], n: int) -> list[int]:
    """What the fake peers decode after `prompt`: its last token + 1, + 2, ... (mod VOCAB); as
    `cpu_speed.probe_reference`, HF's probe tokens that they match."""
    return [(prompt[-1] + i) % VOCAB for i in range(1, n + 1)]


class CountingModel:
    """`llama_cpp.Llama`'s generate surface (and `reset`, which the arm calls before each
    request): the continuation is last token + 1, mod VOCAB."""

    def reset(self) -> None:
        pass

    def generate(self, tokens, reset=True, **_kw):
        last = tokens[-1]
        while True:
            last = (last + 1) % VOCAB
            yield last


class FakePeer:
    def __init__(self, path: str, crash: Mapping[str, str], crash_in: str) -> None:
        self.path, self.crash, self.crash_in = path, dict(crash), crash_in
        self.model = CountingModel()
        self._maybe_crash("load")

    def _maybe_crash(self, call: str) -> None:
        if call == self.crash_in and self.path in self.crash:
            die(self.crash[self.path])

    def info(self) -> dict[str, Any]:
        return {"version": "fake", "fake_path": self.path}

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
        self._maybe_crash("generate")
        return [llamacpp.generate(self.model, p, max_tokens) for p in prompts]

    def perplexity(self, ids: Sequence[int]) -> float:
        return 1.0

    def run(self, items: Sequence[WorkItem]) -> dict[str, Any]:
        self._maybe_crash("run")
        return llamacpp.run_llamacpp(self.model, items)["metrics"]


def fake_peer(
    path: str, *, crash: Mapping[str, str] | None = None, crash_in: str = "generate", **_options
) -> FakePeer:
    """A peer on `path` that dies as `crash[path]` says (`die`) in its `crash_in` call: `load`
    (opening it), `generate` (the probe and the quality pass) or `run` (a measured pass);
    the run's own options (gguf, threads, ...) are ignored."""
    return FakePeer(path, crash or {}, crash_in)
