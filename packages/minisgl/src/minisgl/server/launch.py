"""`python -m minisgl`: start the workers, wait until every one is ready, serve, clean up.

Processes: this one (launcher + API server: FastAPI/uvicorn), `--num-tokenizer` tokenizer /
detokenizer workers and one scheduler + engine worker, all started with multiprocessing
`spawn`. With `MINISGL_CPU_BACKEND=rust_service`: the Rust `minisgl-cpu-service` (tokenizer,
scheduler, detokenizer) and one Python GPU worker instead (`minisgl.cpu_service`). They talk
over ZMQ ipc sockets in a private temp dir that is removed on exit.

A supervisor thread watches the workers: if one dies, `/health` turns 503 and every in-flight
request ends with an error at once. With `--dp N` (N engine workers, or N GPU workers behind the
Rust service) a replica whose worker dies leaves the rotation instead: its requests end with a
503 and the server keeps serving on the others, until the last one dies. SIGINT / SIGTERM: stop accepting, give in-flight requests
`--shutdown-timeout` seconds, then end the rest with a 503 (non-stream) or an SSE error event
(stream), stop the workers (SIGTERM, then SIGKILL) and
remove the ipc dir. The same signal to the whole process group (systemd's KillMode=control-group,
Ctrl+C) drains the same way: a worker ignores SIGINT, and SIGTERM while the launcher drains
(`ipc.setup_worker_process`; the Rust service by the same rule, `service::on_term`); a worker
that gets SIGTERM alone still exits.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

from minisgl import ipc
from minisgl.config import ModelLoadError, check_model_dir
from minisgl.gguf_model import resolve_model_path
from minisgl.message.warmup import WarmUpReport
from minisgl.server.args import LLM_ONLY, ServerArgs, parse_args
from minisgl.server.replicas import replica_threads, worker_names
from minisgl.utils import trace

if TYPE_CHECKING:
    from minisgl.server.frontend import Frontend

SHUTDOWN_REPLY_S = 2  # after --shutdown-timeout: time to write the 503s before uvicorn cancels
WORKER_DEATH_GRACE_S = 5.0  # after a worker died: answer 503s this long, then exit 1


def log(msg: str) -> None:
    print(f"[minisgl launcher pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


class Launcher:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.procs: dict[str, mp.process.BaseProcess] = {}
        self.ipc_dir: str | None = None
        self.frontend = None
        self.sock: socket.socket | None = None
        self.stopping = threading.Event()
        self.phase = "startup"
        self.server = None  # the uvicorn server, once serving
        self.worker_died = False
        self.replica_names = worker_names(args.cpu_backend, args.dp_size)
        self.down: set[str] = set()  # replicas out of rotation (dp > 1)

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum, frame) -> None:
        ipc.mark_launcher(self.ipc_dir, ipc.DRAINING)  # workers that got it too ignore it
        self.stopping.set()
        if self.phase == "startup":
            raise KeyboardInterrupt(f"signal {signum} during startup")

    # ------------------------------------------------------------------ workers
    def _start_workers(self, model_path: str) -> list[str]:
        """Start every process; returns the names whose `Ready` the API server waits for."""
        if self.args.cpu_backend == "rust_service":
            return self._start_service(model_path)
        from minisgl.server.engine_worker import run_engine_worker
        from minisgl.tokenizer.worker import run_tokenizer_worker

        args, ctx = self.args, mp.get_context("spawn")
        typed = args.transport != "generic"
        for i, name in enumerate(self.replica_names):
            self.procs[name] = ctx.Process(
                target=run_engine_worker,
                args=(
                    model_path,
                    self._replica_kwargs(),
                    self.ipc_dir,
                    typed,
                    args.num_tokenizer,
                    i,
                    args.dp_size,
                ),
                name=f"minisgl-{name}",
                daemon=True,
            )
        for i in range(args.num_tokenizer):
            self.procs[ipc.tokenizer_name(i)] = ctx.Process(
                target=run_tokenizer_worker,
                args=(i, model_path, self.ipc_dir, typed, args.dp_size, args.chat_template),
                name=f"minisgl-{ipc.tokenizer_name(i)}",
                daemon=True,
            )
        for p in self.procs.values():
            p.start()
        return list(self.procs)

    def _replica_kwargs(self) -> dict:
        """An engine's `LLM` arguments: `--threads` is per replica (default: its share)."""
        args = self.args
        kwargs = args.llm_kwargs()
        kwargs["threads"] = replica_threads(args.threads, args.dp_size, args.tp_size)
        if args.scheduling_policy != "fcfs":  # the python backend's engine workers only
            kwargs["scheduling_policy"] = args.scheduling_policy
        return kwargs

    def _engine_kwargs(self) -> dict:
        """A rust_service GPU worker's `EngineConfig` arguments (no `LLM`-only options)."""
        kwargs = self._replica_kwargs()
        return {k: v for k, v in kwargs.items() if k not in LLM_ONLY and k != "scheduling_policy"}

    def _start_service(self, model_path: str) -> list[str]:
        """rust_service: the Rust service binary and one Python GPU worker per replica."""
        from minisgl.cpu_service import ServiceProcess, service_command
        from minisgl.server.gpu_worker import run_gpu_worker

        args, ctx = self.args, mp.get_context("spawn")
        typed = args.transport != "generic"
        if not typed:
            raise RuntimeError("MINISGL_CPU_BACKEND=rust_service speaks the typed transport only")
        # MINISGL_DISABLE_OVERLAP_SCHEDULING=1 (`runtime.loop.overlap_disabled`, not imported
        # here: it loads torch): the service's serial loop, depth 1, as it does offline
        serial = os.environ.get("MINISGL_DISABLE_OVERLAP_SCHEDULING", "").strip().lower()
        depth = 1 if serial in ("1", "true", "yes", "on") else 2
        template = None
        if args.chat_template is not None:  # the service renders chats: it reads it from a file
            template = os.path.join(self.ipc_dir, "chat_template.jinja")
            with open(template, "w", encoding="utf-8") as f:
                f.write(args.chat_template)
        limits = args.service_limits()
        cmd = service_command(limits, model_path, self.ipc_dir, args.dp_size, depth, template)
        self.procs[ipc.SERVICE] = ServiceProcess(cmd)
        for i, name in enumerate(self.replica_names):
            self.procs[name] = ctx.Process(
                target=run_gpu_worker,
                args=(i, model_path, self._engine_kwargs(), self.ipc_dir, typed, args.dp_size),
                name=f"minisgl-{name}",
                daemon=True,
            )
        for p in self.procs.values():
            p.start()
        return [ipc.SERVICE]

    def _dead(self) -> tuple[str, str] | None:
        """The first worker that died (replicas already out of rotation aside)."""
        for name, p in self.procs.items():
            if name not in self.down and not p.is_alive():
                return name, f"worker {name} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def _dead_worker(self) -> str | None:
        dead = self._dead()
        return None if dead is None else dead[1]

    def _replica_down(self, name: str, why: str) -> bool:
        """dp > 1: take a dead replica out of rotation; False if it was the last one."""
        if name not in self.replica_names or self.args.dp_size == 1:
            return False
        self.down.add(name)
        left = len(self.replica_names) - len(self.down)
        if not left:
            return False
        replica = self.replica_names.index(name)
        log(f"{why}: replica {replica} is out of rotation, serving on {left} replica(s)")
        self.frontend.replica_down(replica, why)
        if self.args.cpu_backend == "rust_service":
            self._tell_service(replica, why)
        return True

    def _tell_service(self, replica: int, why: str) -> None:
        """The service learns of a dead GPU worker as that worker's failed hello."""
        from minisgl.message.schema import Codec, WorkerHello

        sock = ipc.push(self.frontend.ctx, self.ipc_dir, ipc.STEPS)
        pid = self.procs[self.replica_names[replica]].pid or 0
        sock.send(Codec(True).encode(WorkerHello(replica, pid, error=why)))
        sock.close(linger=1000)

    def _supervise(self) -> None:
        while not self.stopping.wait(0.1):
            found = self._dead()
            if found is None or self._replica_down(*found):
                continue
            name, dead = found
            if name in self.replica_names and self.args.dp_size > 1:
                dead = f"every replica died (the last: {dead})"
            grace = max(self.args.shutdown_timeout, WORKER_DEATH_GRACE_S)
            log(
                f"{dead}; /health now fails, in-flight requests are ended, the server "
                f"exits (code 1) in {grace:.0f}s"
            )
            self.worker_died = True
            self.frontend.mark_unhealthy(dead)
            if not self.stopping.wait(grace) and self.server is not None:
                self.server.should_exit = True
            return

    def _stop_workers(self) -> None:
        ipc.mark_launcher(self.ipc_dir, ipc.STOPPING)  # this SIGTERM is not to be ignored
        for p in self.procs.values():
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
                p.join(2.0)

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        args = self.args
        trace.start_run()  # before the workers start: they inherit the run's name
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            model_path = args.model_path
            if model_path is None:
                from minisgl.default_model import default_model_path

                model_path = str(default_model_path())
            model_path = resolve_model_path(model_path)  # a GGUF file: its converted folder
            self.sock = self._bind()  # before loading anything: a taken port fails at once
            self.ipc_dir = ipc.make_ipc_dir(os.environ.get("MINISGL_IPC_ROOT"))
            from minisgl.server.routes import create_app

            fe = self._start(model_path, self.ipc_dir)
            threading.Thread(target=self._supervise, name="minisgl-supervisor", daemon=True).start()
            self.phase = "serving"
            if self.stopping.is_set():
                return 0
            self._serve(create_app(fe))
            return 1 if self.worker_died else 0
        except KeyboardInterrupt:
            log("interrupted during startup")
            return 130
        except (ModelLoadError, ipc.WorkerStartError) as e:  # the embedded model missing, say
            return startup_error(args, e)
        except Exception as e:
            log(f"failed: {type(e).__name__}: {e}")
            return 1
        finally:
            self._clean_up()

    def _start(self, model_path: str, ipc_dir: str) -> Frontend:
        """The frontend and the workers, once every worker is ready (the engine's limits and
        warm-up in the frontend's `info`)."""
        from minisgl.server.frontend import Frontend

        args = self.args
        self.frontend = fe = Frontend(args, model_path, ipc_dir)
        t0 = time.perf_counter()
        names = self._start_workers(model_path)
        ready = fe.wait_ready(names, args.startup_timeout, self._dead_worker)
        fe.workers = {n: p.pid for n, p in sorted(self.procs.items())}
        fe.replicas.pids = [self.procs[n].pid for n in self.replica_names]
        if ipc.SERVICE in ready:  # the service reports the engine's limits and its own
            fe.info = dict(ready[ipc.SERVICE].info)
        else:
            fe.info = dict(ready[ipc.SCHEDULER].info)
            fe.info["max_token_chars"] = max(
                int(r.info.get("max_token_chars", 0))
                for n, r in ready.items()
                if n not in self.replica_names
            )
        fe.warmup = WarmUpReport.from_info(fe.info)
        if fe.warmup is not None:
            log(f"engine {fe.warmup.summary()} (before /health answers 200)")
        log(
            f"workers ready in {time.perf_counter() - t0:.1f}s: "
            + ", ".join(f"{n}={r.pid}" for n, r in sorted(ready.items()))
            + f"; model {model_path} ({fe.info})"
        )
        return fe

    def _clean_up(self) -> None:
        """However the run ended: the workers stopped, the sockets closed, the ipc dir gone."""
        self.phase = "stopping"
        self.stopping.set()
        if self.frontend is not None:
            self.frontend.serving = False
        self._stop_workers()
        if self.frontend is not None:
            self.frontend.close()
        if self.sock is not None:
            self.sock.close()
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        log("stopped")

    def _bind(self) -> socket.socket:
        host, port = self.args.host, self.args.port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))  # uvicorn listens on it once the workers are ready
        except OSError as e:
            sock.close()
            raise RuntimeError(f"cannot bind {host}:{port}: {e}") from None
        return sock

    def _serve(self, app) -> None:
        import uvicorn

        fe = self.frontend
        ipc_dir = self.ipc_dir

        grace = self.args.shutdown_timeout
        loop, http = uvicorn_stack(self.args)
        fe.http_stack = {"loop": loop, "protocol": http}

        drain_start: list[float] = []  # when a signal started the drain

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:  # stop accepting at once
                # a signal to the process group reached the workers too: they leave it to us
                ipc.mark_launcher(ipc_dir, ipc.DRAINING)
                if fe.serving:
                    fe.serving = False
                    drain_start.append(time.monotonic())
                    log(f"{signal.Signals(sig).name} received: stopping; draining "
                        f"{plural(len(fe.reqs), 'in-flight request')} "
                        f"(--shutdown-timeout {grace:g}s)")  # fmt: skip
                    fe.fail_after(grace, "server is shutting down: the request was still "
                                  f"running after --shutdown-timeout {grace:g}s")  # fmt: skip
                super().handle_exit(sig, frame)

            async def shutdown(self, sockets=None) -> None:
                await super().shutdown(sockets)
                if drain_start:  # the connections closed (or were cancelled) and lifespan ended
                    cut = fe.timed_out
                    how = (
                        f"{plural(cut, 'request')} ended by --shutdown-timeout {grace:g}s"
                        if cut
                        else "every request finished"
                    )
                    log(f"drained in {time.monotonic() - drain_start[0]:.1f}s: {how}")

        config = uvicorn.Config(
            app,
            host=self.args.host,
            port=self.args.port,
            log_level=self.args.log_level,
            # uvicorn cancels what is left only after the requests got their 503 / SSE error
            timeout_graceful_shutdown=math.ceil(grace) + SHUTDOWN_REPLY_S,
            access_log=False,
            loop=loop,
            http=http,
        )
        server = self.server = Server(config)
        log(f"serving on http://{self.args.host}:{self.args.port}")
        server.run(sockets=[self.sock])


def plural(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def uvicorn_stack(args: ServerArgs) -> tuple[str, str]:
    """(event loop, HTTP protocol) the API server runs: `auto` takes uvloop / httptools when
    installed (plain dependencies on Linux), else asyncio / h11."""

    def pick(choice: str, fast: str, plain: str) -> str:
        if choice != "auto":
            return choice
        return fast if importlib.util.find_spec(fast) is not None else plain

    return pick(args.loop, "uvloop", "asyncio"), pick(args.http, "httptools", "h11")


def startup_error(args: ServerArgs, e: Exception) -> int:
    """A start-up error its user fixes (a model path that is no model folder): one line saying
    what is wrong and what to do, exit code 2 (as argparse's usage errors); the traceback only
    at `--log-level debug`."""
    if args.log_level.lower() == "debug":
        traceback.print_exception(e)
    print(f"minisgl: error: {e}", file=sys.stderr, flush=True)
    return 2


def check_model(args: ServerArgs) -> None:
    """The model folder as the engine reads it first (config.json; the safetensors headers
    unless no weights load), before any worker starts: a ModelLoadError saying what is wrong,
    not each worker's traceback. The embedded model (no --model-path) is checked by its
    loader. A GGUF file is checked, and converted into its folder, here."""
    if args.model_path is not None:
        no_weights = args.dummy_weights or args.sim_device is not None
        check_model_dir(resolve_model_path(args.model_path), weights=not no_weights)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # under torchrun: WORLD_SIZE checked against --tp x --dp
    if args.log_level.lower() == "debug":  # the workers print their failed starts' tracebacks
        os.environ[ipc.TRACEBACKS] = "1"
    try:
        check_model(args)
    except ModelLoadError as e:
        return startup_error(args, e)
    from minisgl.distributed.launch import torchrun_env

    env = torchrun_env()
    if env is not None and env.rank > 0:
        return follow(args)
    return Launcher(args).run()


def follow(args: ServerArgs) -> int:
    """A torchrun rank > 0: no server, no workers; rank 0's engine worker sends it every step
    (`minisgl.distributed.launch`), its exit code when rank 0 ends."""
    from minisgl.config import EngineConfig
    from minisgl.engine.sim import make_engine

    model_path = args.model_path
    if model_path is None:
        from minisgl.default_model import default_model_path

        model_path = str(default_model_path())
    model_path = resolve_model_path(model_path)
    try:
        kwargs = args.engine_kwargs()
        make_engine(EngineConfig(model_path=model_path, **kwargs))
    except SystemExit as e:  # the follower's end
        return e.code if isinstance(e.code, int) else 1
    except ValueError as e:
        log(f"failed: {e}")
        return 1
    return 1  # unreachable: a rank > 0 never gets an engine back
