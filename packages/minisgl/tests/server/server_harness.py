"""Start / stop real servers for tests: free loopback port, private ipc dir, no survivors."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

START_TIMEOUT_S = 240.0  # spawn + torch import on a busy 2-core machine
STOP_TIMEOUT_S = 30.0
MAX_RUNNING = 16
MAX_QUEUED = 48
SERVER_FLAGS = [
    "--max-running-requests", str(MAX_RUNNING),
    "--max-queued-requests", str(MAX_QUEUED),
    "--num-pages", "4096",
    "--max-seq-len-override", "256",
    "--max-prefill-length", "512",
    "--shutdown-timeout", "3",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerHandle:
    def __init__(self, proc: subprocess.Popen, port: int, ipc_root: str, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.ipc_root = ipc_root
        self.log_path = log_path
        self.children: list[psutil.Process] = []

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-6000:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    self.children = psutil.Process(self.proc.pid).children(recursive=True)
                    return
            time.sleep(0.25)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

    def worker_pids(self) -> dict[str, int]:
        return httpx.get(self.base_url + "/health", timeout=5).json()["workers"]

    def in_flight(self) -> int:
        return httpx.get(self.base_url + "/health", timeout=5).json()["in_flight"]

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_TIMEOUT_S)
        return self.proc.poll()

    def kill_everything(self) -> None:
        for p in [*self.children]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def survivors(self, grace: float = 5.0) -> list[psutil.Process]:
        """Children still running `grace` seconds after the launcher exited."""
        deadline = time.monotonic() + grace
        while True:
            alive = []
            for p in self.children:
                with contextlib.suppress(psutil.Error):
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                        alive.append(p)
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)


@contextlib.contextmanager
def running_server(model_dir, *extra: str, log_dir: Path, env: dict | None = None):
    """Start `python -m minisgl`, wait for /health, yield; then SIGTERM and check cleanup."""
    ipc_root = tempfile.mkdtemp(prefix="msgl-t", dir="/tmp")  # short: ipc paths <= 107 bytes
    full_env = {**os.environ, "MINISGL_IPC_ROOT": ipc_root, **(env or {})}
    for attempt in range(3):  # the launcher binds first: a port taken meanwhile fails at once
        port = free_port()
        log_path = log_dir / f"server-{port}.log"
        cmd = [sys.executable, "-m", "minisgl", "--model-path", str(model_dir), "--host",
               "127.0.0.1", "--port", str(port), *SERVER_FLAGS, *extra]  # fmt: skip
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
            )
        server = ServerHandle(proc, port, ipc_root, log_path)
        server.model_dir = Path(model_dir)
        try:
            server.wait_ready()
            break
        except RuntimeError:
            if attempt == 2 or "cannot bind" not in server.log():
                server.kill_everything()
                shutil.rmtree(ipc_root, ignore_errors=True)
                raise
        except BaseException:
            server.kill_everything()
            shutil.rmtree(ipc_root, ignore_errors=True)
            raise
    try:
        yield server
    finally:
        code = server.stop()
        survivors = server.survivors()
        server.kill_everything()
        leftover = os.listdir(ipc_root) if os.path.isdir(ipc_root) else []
        shutil.rmtree(ipc_root, ignore_errors=True)
        assert code is not None, f"server ignored SIGTERM for {STOP_TIMEOUT_S}s:\n{server.log()}"
        assert not survivors, f"child processes survived: {survivors}"
        assert not leftover, f"ipc files left behind: {leftover}"


def metric(text: str, name: str, labels: str = "", default: float | None = None) -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    if m is None and default is not None:  # a labelled counter appears at its first event
        return default
    assert m, f"{name}{labels} missing"
    return float(m.group(1))
