"""The `rust_service` backend's processes, as the launcher starts them: the Rust
`minisgl-cpu-service` binary (a subprocess) and the Python GPU workers (`gpu_worker`).

The service binds its inboxes (`ipc.SERVICE` for the API server, `ipc.STEPS` for the workers),
waits for every worker's `WorkerHello`, checks its schema version, answers `HelloAck`, and only
then reports `Ready` to the API server with the engine's limits. It exits when the launcher
(its parent) is gone, on SIGTERM / SIGINT, or on a fatal protocol error (exit code 1).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

from minisgl.server.args import ServerArgs

BINARY = "minisgl-cpu-service"
ENV_BINARY = "MINISGL_CPU_SERVICE_BIN"


def service_binary() -> Path:
    """The service binary: $MINISGL_CPU_SERVICE_BIN, else on PATH (`nox` installs it into the
    venv), else the release build of this checkout."""
    explicit = os.environ.get(ENV_BINARY)
    if explicit:
        return Path(explicit)
    found = shutil.which(BINARY)
    if found:
        return Path(found)
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "rust" / "target" / "release" / BINARY
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{BINARY} not found (set {ENV_BINARY}, or build it: "
        "cargo build --release -p minisgl-cpu-service --manifest-path rust/Cargo.toml)"
    )


def service_command(args: ServerArgs, model_path: str, ipc_dir: str, num_workers: int) -> list:
    cmd = [
        str(service_binary()), "serve",
        "--ipc-dir", ipc_dir,
        "--model-path", model_path,
        "--num-workers", str(num_workers),
        "--page-size", str(args.page_size),
        "--max-running-requests", str(args.max_running_requests),
        "--max-prefill-length", str(args.max_prefill_length),
        "--cache-type", args.cache_type,
        "--parent-pid", str(os.getpid()),
    ]  # fmt: skip
    trace = os.environ.get("MINISGL_SERVICE_TRACE")
    if trace:
        cmd += ["--trace", trace]
    return cmd


class ServiceProcess:
    """A `subprocess.Popen` with the slice of `multiprocessing.Process` the launcher uses."""

    def __init__(self, cmd: list[str]) -> None:
        self.cmd = cmd
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def exitcode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def join(self, timeout: float | None = None) -> None:
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
