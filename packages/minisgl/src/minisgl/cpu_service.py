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
import sysconfig
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

BINARY = "minisgl-cpu-service"
ENV_BINARY = "MINISGL_CPU_SERVICE_BIN"
INSTALL = 'pip install "minisgl[rust]"'


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_service_binary(env: Mapping[str, str], scripts: Path, roots: Iterable[Path]) -> Path:
    """The first of: `env[MINISGL_CPU_SERVICE_BIN]` (it must exist); `scripts` (the interpreter's
    scripts dir, where `pip install "minisgl[rust]"` puts it, on PATH or not); `env["PATH"]`;
    `$CARGO_TARGET_DIR/{release,debug}`; `rust/target/{release,debug}` under one of `roots`
    (a checkout above the sources)."""
    explicit = env.get(ENV_BINARY)
    if explicit:
        if not _executable(Path(explicit)):
            raise FileNotFoundError(f"{ENV_BINARY}={explicit} is not an executable file")
        return Path(explicit)
    targets = [Path(env["CARGO_TARGET_DIR"])] if env.get("CARGO_TARGET_DIR") else []
    targets += [root / "rust" / "target" for root in roots]
    builds = [target / profile / BINARY for target in targets for profile in ("release", "debug")]
    on_path = shutil.which(BINARY, path=env.get("PATH", ""))
    candidates = [scripts / BINARY, *([Path(on_path)] if on_path else []), *builds]
    found = next((c for c in candidates if _executable(c)), None)
    if found is not None:
        return found
    raise FileNotFoundError(
        f"{BINARY} not found in {scripts}, on PATH or in a cargo build of a checkout: {INSTALL} "
        f"(or set {ENV_BINARY}, or in a checkout: "
        "cargo build --release -p minisgl-cpu-service --manifest-path rust/Cargo.toml)"
    )


def service_binary() -> Path:
    """The service binary for this interpreter and checkout (`find_service_binary`)."""
    scripts = Path(sysconfig.get_path("scripts"))
    return find_service_binary(os.environ, scripts, Path(__file__).resolve().parents)


@dataclass(frozen=True)
class ServiceLimits:
    """The scheduler limits the service is started with."""

    page_size: int
    max_running_requests: int
    max_prefill_length: int
    cache_type: str
    dp_routing: str | None = None  # data-parallel replicas: prefix | round_robin (the default)
    cache_outputs: bool = (
        True  # False: finished requests cache their prompts only (--deterministic)
    )
    priority_aging_steps: int | None = None  # priority scheduling (params.priority); None: FIFO


def service_command(
    limits: ServiceLimits,
    model_path: str,
    ipc_dir: str,
    num_workers: int,
    depth: int = 2,
    chat_template_file: str | None = None,
) -> list:
    """`depth`: steps in flight at once (1: serial, 2: one step ahead); `chat_template_file`:
    a chat template the service renders chats with instead of the model's."""
    cmd = [
        str(service_binary()), "serve",
        "--ipc-dir", ipc_dir,
        "--model-path", model_path,
        "--num-workers", str(num_workers),
        "--page-size", str(limits.page_size),
        "--max-running-requests", str(limits.max_running_requests),
        "--max-prefill-length", str(limits.max_prefill_length),
        "--cache-type", limits.cache_type,
        "--depth", str(depth),
        "--parent-pid", str(os.getpid()),
    ]  # fmt: skip
    if limits.dp_routing is not None:
        cmd += ["--dp-routing", limits.dp_routing]
    if not limits.cache_outputs:
        cmd += ["--no-cache-outputs"]
    if limits.priority_aging_steps is not None:
        cmd += ["--priority-aging-steps", str(limits.priority_aging_steps)]
    if chat_template_file is not None:
        cmd += ["--chat-template-file", chat_template_file]
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
