"""ZMQ ipc sockets (in the launcher's private temp dir) and worker-process plumbing."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

import zmq

from minisgl.utils.gcfreeze import freeze_startup_heap

FRONTEND = "frontend"  # API server PULL: outputs, stats, readiness
SCHEDULER = "scheduler"  # scheduler PULL: requests, aborts, finishes
SERVICE = "service"  # rust_service: the service's PULL for the API server's requests / aborts
STEPS = "steps"  # rust_service: the service's PULL for the workers' hellos and step results


def tokenizer_name(i: int) -> str:
    return f"tokenizer{i}"


def scheduler_name(replica: int) -> str:
    """Engine worker `replica`'s PULL (python backend; replica 0 keeps the plain name)."""
    return SCHEDULER if replica == 0 else f"{SCHEDULER}{replica}"


def replica_of(uid: int, dp: int) -> int:
    """The engine replica (of `dp`) that serves request `uid`: its messages go to that
    replica's socket (`scheduler_name`)."""
    return uid % dp


def worker_name(i: int) -> str:
    """rust_service: GPU worker i's PULL (steps from the service)."""
    return f"worker{i}"


def ingress_names(cpu_backend: str, num_tokenizer: int) -> list[str]:
    """Where the API server sends requests: the Rust service, or the tokenizer workers."""
    if cpu_backend == "rust_service":
        return [SERVICE]
    return [tokenizer_name(i) for i in range(num_tokenizer)]


def addr(ipc_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(ipc_dir, name)}"


def pull(ctx: zmq.Context, ipc_dir: str, name: str) -> zmq.Socket:
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.bind(addr(ipc_dir, name))
    return s


def push(ctx: zmq.Context, ipc_dir: str, name: str) -> zmq.Socket:
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(addr(ipc_dir, name))
    return s


def drain(sock: zmq.Socket, first_timeout_ms: int, limit: int = 4096) -> list[bytes]:
    """Wait up to `first_timeout_ms` for one frame, then take everything already queued."""
    if not sock.poll(first_timeout_ms, zmq.POLLIN):
        return []
    return take(sock, limit)


def take(sock: zmq.Socket, limit: int = 4096) -> list[bytes]:
    """Everything already queued (up to `limit` frames), without waiting."""
    out: list[bytes] = []
    while len(out) < limit:
        try:
            out.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            break
    return out


# `MINISGL_FAULT_STEP_DELAY_MS`: a worker sleeps before every engine step (tests of disconnects
# and timeouts that must not depend on how fast the machine generates). Never set in production.
FAULT_STEP_DELAY_S = float(os.environ.get("MINISGL_FAULT_STEP_DELAY_MS", "0")) / 1000.0
# `MINISGL_FAULT_STEP_CPU_MS`: a worker spins for this much of its own CPU time before every
# step: a slower build whose extra cost is CPU work, as a real control-plane regression is (the
# release trial's, issue 41: on a loaded machine a sleep hides in the wait for a core).
FAULT_STEP_CPU_S = float(os.environ.get("MINISGL_FAULT_STEP_CPU_MS", "0")) / 1000.0


def fault_step_delay() -> None:
    """Fault injection: a slow engine (no-op unless MINISGL_FAULT_STEP_DELAY_MS or
    MINISGL_FAULT_STEP_CPU_MS is set)."""
    if FAULT_STEP_DELAY_S:
        time.sleep(FAULT_STEP_DELAY_S)
    if FAULT_STEP_CPU_S:
        end = time.thread_time() + FAULT_STEP_CPU_S
        while time.thread_time() < end:
            pass


# "1": a worker prints the traceback of its failed start (the launcher's --log-level debug)
TRACEBACKS = "MINISGL_WORKER_TRACEBACKS"


class WorkerStartError(RuntimeError):
    """A worker reported that it failed to start (its one-line error in the message)."""


def startup_failure(e: BaseException) -> str:
    """In a worker whose start failed: the one line it reports to the launcher, which prints it
    (`WorkerStartError`); the traceback only where the launcher runs at --log-level debug. It is
    exiting from here on: a SIGTERM (the launcher stopping every worker) ends it at once, not as
    a WorkerExit raised inside its exit handlers."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if os.environ.get(TRACEBACKS) == "1":
        traceback.print_exception(e)
    return " ".join(f"{type(e).__name__}: {e}".split())


class WorkerExit(BaseException):
    """SIGTERM in a worker: a BaseException, so no `except Exception` on the way swallows it."""


PID_FILE = "launcher.pid"
DIR_PREFIX = "minisgl-"


def make_ipc_dir(root: str | None) -> str:
    """A private ipc dir under `root` (default: the temp dir), marked with this pid; dirs left by
    launchers that were killed (their pid is gone) are removed first."""
    remove_stale_dirs(root)
    path = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=root)
    with open(os.path.join(path, PID_FILE), "w") as f:
        f.write(str(os.getpid()))
    return path


def remove_stale_dirs(root: str | None) -> list[str]:
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, PID_FILE)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue  # not ours, or still being created
        if not name.startswith(DIR_PREFIX) or _alive(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# The launcher's state, as marker files in its ipc dir, for a worker that got SIGTERM: whether
# the signal went to the whole process group (systemd's KillMode=control-group, `docker stop` on
# a shell entrypoint: the launcher got it too and drains) or to this worker alone.
DRAINING = "launcher.draining"  # the launcher got SIGTERM / SIGINT: it drains, then stops us
STOPPING = "launcher.stopping"  # the launcher stops the workers now
GROUP_SIGNAL_WAIT_S = 1.0  # a worker's SIGTERM: how long it waits for the launcher's DRAINING


def mark_launcher(ipc_dir: str | None, state: str) -> None:
    """In the launcher (a signal handler too): tell the workers `state` (DRAINING / STOPPING)."""
    if ipc_dir is not None:
        with contextlib.suppress(OSError):
            open(os.path.join(ipc_dir, state), "a").close()


def setup_worker_process(ipc_dir: str | None = None) -> Callable[[], bool]:
    """In a worker: Ctrl+C is the launcher's business; SIGTERM asks for a clean exit, unless
    the launcher got it too (a signal to the process group): then the launcher drains the
    in-flight requests and stops the workers itself once done (`ipc_dir`'s DRAINING, then
    STOPPING), so the worker ignores it. SIGTERM to the worker alone (no DRAINING within
    GROUP_SIGNAL_WAIT_S), or once the launcher is gone, ends it as before.

    Returns `alive()`: False once the launcher is gone (so a worker never outlives it).
    """
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def alive() -> bool:
        return os.getppid() == parent

    def marked(state: str) -> bool:
        return os.path.exists(os.path.join(ipc_dir, state))

    def on_term(signum: int, frame: object) -> None:
        if ipc_dir is None:
            raise WorkerExit()
        deadline = time.monotonic() + GROUP_SIGNAL_WAIT_S
        while alive() and not marked(STOPPING):
            if marked(DRAINING):
                return  # the launcher's signal too: it stops this worker after the drain
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        raise WorkerExit()

    signal.signal(signal.SIGTERM, on_term)
    return alive


def worker_log(name: str, msg: str) -> None:
    print(f"[minisgl {name} pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


T = TypeVar("T")


class WorkerProcess:
    """One worker process's life, written once for the engine, tokenizer and GPU workers.

    Made first thing in the worker: its signals (`setup_worker_process`; `alive()`), one zmq
    context (`ctx`) and the PUSH its readiness goes to (`report`: the API server's FRONTEND, or
    the Rust service's STEPS). Then, in order:

    - `start(build, failed)`: the worker's set-up (its sockets, model, tokenizer, warm-up). A
      SIGTERM meanwhile (another worker failed: the launcher stops them all) ends it quietly
      (None); any other error is reported as `failed(one line)` (`startup_failure`), delivered,
      and the process exits 1.
    - `ready(hello)`: the warmed-up heap frozen (`freeze_startup_heap`), then the readiness
      message `hello(objects frozen)` sent.
    - `serve(loop, close)`: the worker's loop, until it returns or a SIGTERM (`WorkerExit`)
      ends it; then `close()` and the context destroyed, whatever ended it.
    """

    def __init__(self, ipc_dir: str, report_to: str) -> None:
        self.alive = setup_worker_process(ipc_dir)
        self.ctx = zmq.Context()
        self.report = push(self.ctx, ipc_dir, report_to)

    def start(self, build: Callable[[], T], failed: Callable[[str], bytes]) -> T | None:
        try:
            return build()
        except WorkerExit:  # stopped while it starts: a quiet exit
            self.ctx.destroy(linger=0)
            return None
        except Exception as e:
            self.report.send(failed(startup_failure(e)))
            self.report.close(linger=1000)  # the context's end waits (<= 1 s) for the line
            self.ctx.destroy(linger=0)
            raise SystemExit(1) from None

    def ready(self, hello: Callable[[int], bytes]) -> None:
        self.report.send(hello(freeze_startup_heap()))  # last: the warmed-up process's heap

    def serve(self, loop: Callable[[], None], close: Callable[[], None] | None = None) -> None:
        try:
            loop()
        except WorkerExit:
            pass
        finally:
            if close is not None:
                close()
            self.ctx.destroy(linger=0)
