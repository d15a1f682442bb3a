"""Start / stop real servers for tests (`python -m minisgl` in a subprocess): free loopback
port, private ipc dir, no survivors; and the /metrics helpers the server tests share."""

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
from dataclasses import dataclass
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
def running_server(
    model_dir,
    *extra: str,
    log_dir: Path,
    env: dict | None = None,
    python: str = sys.executable,
    launcher: tuple[str, ...] = (),
):
    """Start `python -m minisgl` (`python`: another interpreter, e.g. a fresh venv's;
    `launcher`: arguments before `-m minisgl`, e.g. `-m torch.distributed.run ...` for torchrun),
    wait for /health, yield; then SIGTERM and check cleanup."""
    ipc_root = tempfile.mkdtemp(prefix="msgl-t", dir="/tmp")  # short: ipc paths <= 107 bytes
    full_env = {**os.environ, "MINISGL_IPC_ROOT": ipc_root, **(env or {})}
    for attempt in range(3):  # the launcher binds first: a port taken meanwhile fails at once
        port = free_port()
        log_path = log_dir / f"server-{port}.log"
        cmd = [python, *launcher, "-m", "minisgl", "--model-path", str(model_dir), "--host",
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


def metrics(server) -> str:
    return httpx.get(server.base_url + "/metrics", timeout=10).text


def wait_kv_clean(server, timeout: float = 30.0) -> str:
    """Until nothing runs, every used page belongs to the prefix cache (no leak) and an
    integrity check ran since the last request (the engine checks once idle a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        text = metrics(server)
        running = metric(text, "minisgl_num_running_requests")
        queued = metric(text, "minisgl_num_queued_requests")
        used = metric(text, "minisgl_kv_pages_used")
        cached = metric(text, "minisgl_kv_pages_cached")
        inflight = metric(text, "minisgl_requests_in_flight")
        ok = metric(text, "minisgl_kv_integrity_ok")
        pending = metric(text, "minisgl_kv_integrity_pending", default=0)
        if running == queued == inflight == 0 and used == cached and ok == 1 and not pending:
            return text
        if time.monotonic() > deadline:
            raise AssertionError(
                f"KV not clean: running={running} queued={queued} "
                f"used={used} cached={cached} in_flight={inflight} ok={ok} pending={pending}"
            )
        time.sleep(0.1)


@dataclass
class Started:
    """A server that started (`handle`) or the reason it did not (`error`)."""

    name: str
    handle: ServerHandle | None
    error: str = ""

    def get(self) -> ServerHandle:
        assert self.handle is not None, f"server {self.name!r} did not start:\n{self.error}"
        return self.handle


@contextlib.contextmanager
def start(
    name: str,
    model: Path,
    *flags: str,
    log_dir: Path,
    backend: str,
    env=None,
    launcher: tuple[str, ...] = (),
):
    """Yield a `Started`; the server (if any) is stopped and checked for leftovers after."""
    full_env = {"MINISGL_CPU_BACKEND": backend, **(env or {})}
    cm = running_server(model, *flags, log_dir=log_dir, env=full_env, launcher=launcher)
    try:
        handle = cm.__enter__()
    except Exception as e:  # recorded: the test that needs it fails by assertion
        yield Started(name, None, f"{type(e).__name__}: {e}")
        return
    try:
        yield Started(name, handle)
    finally:
        cm.__exit__(None, None, None)
