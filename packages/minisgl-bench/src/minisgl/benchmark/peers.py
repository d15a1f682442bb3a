"""Peers of a comparison (other engines: llama.cpp, vLLM's CPU build), each in a process of its
own, so that a peer whose native code crashes (llama.cpp's AMX path segfaults in `decode` on the
embedded Q4_1 GGUF) is reported as a crash instead of ending the run; a peer that pins its own
torch (vLLM) runs in its own virtualenv's interpreter (`PeerSpec.python_env`).

A peer is registered by a `PeerSpec`: its `entry`, "module:function", is called in the peer's
process as `function(path, **options)` and returns an object with

    info() -> dict                                   # version, build, settings: for the record
    generate(prompts, max_tokens) -> list[list[int]] # greedy, exactly max_tokens each
    perplexity(ids) -> float
    run(items: list[WorkItem]) -> dict               # one pass's metrics (offline.request_metrics)

and `paths` names the ways to open it, tried in order until one works (llama.cpp: `default`,
then `no_extra_bufts`). The process speaks JSON lines on its standard input and on a copy of
its standard output (its own fd 1 goes to stderr, where a native library's prints belong).

    python -m minisgl.benchmark.peers ENTRY PATH OPTIONS_JSON   # the peer's process
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from minisgl.benchmark.profiles import WorkItem


@dataclasses.dataclass(frozen=True)
class PeerSpec:
    """A peer: `entry` ("module:function") opens it on one of `paths` (tried in order);
    `requires` is the module it imports (checked before a run starts, with `install_hint`);
    `options` go to `entry` beside the run's own. `python_env` names the variable that holds
    the interpreter the peer runs in (a virtualenv of its own, `python_default` when unset);
    None: this interpreter."""

    name: str
    entry: str
    paths: tuple[str, ...] = ("default",)
    requires: str | None = None
    install_hint: str = ""
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    python_env: str | None = None
    python_default: str = ""

    def interpreter(self) -> str:
        if self.python_env is None:
            return sys.executable
        return os.environ.get(self.python_env) or self.python_default

    def available(self) -> bool:
        if self.requires is None:
            return True
        if self.python_env is not None:  # asked of the peer's own interpreter
            probe = (
                f"import importlib.util as u, sys; sys.exit(u.find_spec({self.requires!r}) is None)"
            )
            try:
                done = subprocess.run([self.interpreter(), "-c", probe], capture_output=True,
                                      timeout=120, env=peer_environ())  # fmt: skip
            except (OSError, subprocess.TimeoutExpired):
                return False
            return done.returncode == 0
        try:
            return importlib.util.find_spec(self.requires) is not None
        except (ImportError, ValueError):  # ValueError: sys.modules holds None (import blocked)
            return False


def _llamacpp_spec() -> PeerSpec:
    from minisgl.benchmark.llamacpp import INSTALL_HINT, PATHS

    return PeerSpec("llamacpp", "minisgl.benchmark.llamacpp:open_peer", PATHS, "llama_cpp",
                    f"the llama.cpp arm needs llama-cpp-python: {INSTALL_HINT}")  # fmt: skip


def _vllm_spec() -> PeerSpec:
    from minisgl.benchmark.vllm_cpu import DEFAULT_PYTHON, INSTALL_HINT, PATHS, PYTHON_ENV

    return PeerSpec("vllm", "minisgl.benchmark.vllm_cpu:open_peer", PATHS, "vllm", INSTALL_HINT,
                    python_env=PYTHON_ENV, python_default=DEFAULT_PYTHON)  # fmt: skip


PEERS: dict[str, PeerSpec] = {"llamacpp": _llamacpp_spec(), "vllm": _vllm_spec()}


class PeerFailed(RuntimeError):
    """A peer's call did not return: its process died (`outcome` "crashed": `signal`, its
    name or None, and `exit_code`, negative for a signal as subprocess gives it) or the call
    raised (`outcome` "error": `error`, the exception's last line)."""

    def __init__(self, attempt: dict[str, Any]) -> None:
        self.attempt = attempt
        super().__init__(describe(attempt))


def describe(attempt: Mapping[str, Any]) -> str:
    """One line for an attempt of the record: `default: SIGSEGV in probe`."""
    where = f"{attempt['path']}: "
    if attempt["outcome"] == "ok":
        return where + "ok"
    if attempt["outcome"] == "error":
        return where + f"error in {attempt['phase']}: {attempt['error']}"
    how = attempt["signal"] or f"exit status {attempt['exit_code']}"
    return where + f"{how} in {attempt['phase']}"


def crash_of(returncode: int | None) -> dict[str, Any]:
    """The record's fields of a dead process's status (`Popen.returncode`)."""
    sig = None
    if returncode is not None and returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:
            sig = f"signal {-returncode}"
    return {"outcome": "crashed", "signal": sig, "exit_code": returncode}


class PeerProcess:
    """One peer opened on one path in a process of its own; every call either returns the
    peer's answer or raises `PeerFailed` naming the path and the phase (the caller's word for
    what it was doing)."""

    def __init__(self, spec: PeerSpec, path: str, options: Mapping[str, Any]) -> None:
        self.spec, self.path = spec, path
        opts = json.dumps({**spec.options, **options})
        cmd = [spec.interpreter(), "-m", "minisgl.benchmark.peers", spec.entry, path, opts]
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, env=peer_environ())  # fmt: skip
        except OSError as exc:  # no such interpreter
            raise PeerFailed({"path": path, "phase": "load", "outcome": "error",
                              "error": f"{type(exc).__name__}: {exc}"}) from None  # fmt: skip
        try:
            self.info: dict[str, Any] = self._reply("load")
        except PeerFailed:
            self.close()
            raise

    def call(self, phase: str, method: str, *args: Any) -> Any:
        try:
            self.proc.stdin.write(
                json.dumps({"method": method, "args": args}, default=_json) + "\n"
            )
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # dead already: _reply says how
        return self._reply(phase)

    def _reply(self, phase: str) -> Any:
        line = self.proc.stdout.readline()
        if not line:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            raise PeerFailed({"path": self.path, "phase": phase, **crash_of(self.proc.wait())})
        msg = json.loads(line)
        if "error" in msg:
            raise PeerFailed({"path": self.path, "phase": phase, "outcome": "error",
                              "error": msg["error"]})  # fmt: skip
        return msg["ok"]

    def close(self, timeout: float = 30.0) -> None:
        """End the process (EOF on its input; killed if it has not exited after `timeout`)."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def peer_environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a peer's process starts with: `base` (this process's) less the OpenMP
    variables `import minisgl` set for its own threads (`MINISGL_OPENMP_SET` names them), and
    `MINISGL_OPENMP=keep`, so that the peer's own import of minisgl sets none: a peer runs with
    its OpenMP library's defaults, as its users get them, or with what the caller set."""
    env = dict(os.environ if base is None else base)
    made = env.pop("MINISGL_OPENMP_SET", "")
    for name in filter(None, made.split(",")):
        env.pop(name, None)
    env["MINISGL_OPENMP"] = "keep"
    return env


# what a peer's record says of the OpenMP settings its process ran with
OPENMP_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _json(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return str(obj)


def open_first(
    spec: PeerSpec, options: Mapping[str, Any], check: Callable[[PeerProcess], None]
) -> tuple[PeerProcess | None, list[dict[str, Any]]]:
    """The peer on the first of its paths where it opens and `check` (the caller's probe:
    `PeerProcess.call`s) passes, and every attempt, in order: `{"path", "outcome": "ok"}` or a
    `PeerFailed`'s. (None, attempts) when no path works."""
    attempts: list[dict[str, Any]] = []
    for path in spec.paths:
        peer = None
        try:
            peer = PeerProcess(spec, path, options)
            check(peer)
        except PeerFailed as failed:
            attempts.append(failed.attempt)
            if peer is not None:
                peer.close()
            continue
        attempts.append({"path": path, "outcome": "ok"})
        return peer, attempts
    return None, attempts


# --- the peer's process


def _items(raw: Sequence[Mapping[str, Any]]) -> list[WorkItem]:
    return [WorkItem(**item) for item in raw]


def serve(entry: str, path: str, options: Mapping[str, Any]) -> int:
    """Open the peer (`entry` on `path`), answer its info, then one call a line until EOF."""
    import faulthandler

    faulthandler.enable()  # a native crash prints the Python stack, then dies of its signal
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the peer prints goes to stderr, not into the answers
    sys.stdout = sys.stderr

    def answer(fn: Callable[[], Any]) -> None:
        try:
            msg = {"ok": fn()}
        except Exception as exc:  # the peer's error, for the record: the run goes on
            traceback.print_exc()
            msg = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(msg, default=_json) + "\n")
        out.flush()

    module, _, name = entry.partition(":")
    peer: list[Any] = []

    def load() -> dict[str, Any]:
        from minisgl.utils.malloc import keep_freed_memory

        kept = keep_freed_memory()  # the allocator the minisgl and HF arms run with
        peer.append(getattr(importlib.import_module(module), name)(path, **options))
        openmp = {name: os.environ.get(name) for name in OPENMP_ENV}
        return {**peer[0].info(), "malloc_tuned": kept, "openmp_env": openmp}

    answer(load)
    if not peer:
        return 1
    for line in sys.stdin:
        call = json.loads(line)
        args = call["args"]
        if call["method"] == "run":
            args = [_items(args[0])]
        answer(lambda c=call, a=args: getattr(peer[0], c["method"])(*a))
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
