"""The API server's `Frontend`: admission of a request to the tokenizers and its outputs
back, over ZMQ.

A receiver thread owns the PULL socket (readiness, detokenized outputs, rejections, scheduler
stats) until the event loop runs, then the loop reads it. Each request is a `Job`: its choices
(one uid each) are admitted (bounded), sent to the tokenizer that owns the uid
(uid % num_tokenizer), and their outputs land in the job's `Mailbox` for its HTTP handler
(`responses.py`, `sse.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from minisgl import ipc
from minisgl.default_model import served_name
from minisgl.message.schema import (
    AbortReq,
    Admitted,
    Codec,
    DetokOut,
    Ready,
    Reject,
    Stats,
    TokenizeReq,
)
from minisgl.message.warmup import WarmUpReport
from minisgl.reasoning import get_reasoning_format
from minisgl.server.args import ServerArgs
from minisgl.server.http_warmup import HttpWarmUp
from minisgl.server.mailbox import GONE, Accepted, Failure, Gone, Item, Mailbox
from minisgl.server.metrics import Metrics
from minisgl.server.protocol import APIError, ModelNames, Parsed
from minisgl.server.replicas import Replicas, worker_names
from minisgl.tools.render import ChatRenderer
from minisgl.utils import trace
from minisgl.utils.log import get_logger

logger = get_logger(__name__)

RETRY_AFTER_S = "1"
RECV_POLL_MS = 20  # the receiver thread's poll before serving (how long attach_loop may wait)
# dp > 1: the replica that admitted a request, a server extension strict OpenAI clients ignore
# (the body's / the stream's last chunks' `minisgl` object, and this header)
REPLICA_HEADER = "X-Minisgl-Replica"


class ClientGone(Exception):
    """The HTTP client disconnected: the request is aborted."""


@dataclass(eq=False)
class ReqState:
    """One choice of a request, as the engine sees it (one uid)."""

    uid: int
    index: int
    mailbox: Mailbox  # shared by every choice of the request
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_last: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finished: bool = False
    replica: int | None = None  # the data-parallel replica that admitted it (`Admitted`)


@dataclass(eq=False)
class Job:
    """A request's choices (n of them) and its outputs; `Frontend.job` owns its lifetime."""

    states: list[ReqState]
    mailbox: Mailbox = field(default_factory=Mailbox)
    gone: bool = False  # the client disconnected
    watcher: asyncio.Task | None = None

    def watch(self, receive: Callable[[], Awaitable[dict]]) -> None:
        """Notice the client leaving: one task awaits the connection's `http.disconnect` (the
        body is read by then; uvicorn answers the next `receive` only when the client leaves
        or the response completed), then marks the job gone and wakes its handler."""

        async def run() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.gone = True
            self.mailbox.put(GONE)

        self.watcher = asyncio.get_running_loop().create_task(run())

    def unwatch(self) -> None:
        if self.watcher is not None and not self.watcher.done():
            self.watcher.cancel()

    @property
    def prompt_tokens(self) -> int:
        """The prompt's tokens (its choices share it): 0 until a choice's first output."""
        return next((st.prompt_tokens for st in self.states if st.prompt_tokens), 0)

    @property
    def completion_tokens(self) -> int:
        return sum(st.completion_tokens for st in self.states)

    @property
    def replica(self) -> int | None:
        """The replica of its choices (n > 1: one replica; the first that said, else None)."""
        return next((st.replica for st in self.states if st.replica is not None), None)


async def next_item(job: Job) -> Item:
    """The request's next output (a choice's text as it accumulated); raises ClientGone once the
    client disconnected (the job's watcher wakes the wait: nothing polls the connection)."""
    if job.gone:
        raise ClientGone()
    box = job.mailbox
    if not box:
        await box.wait()
    item = box.pop()
    if isinstance(item, Gone):
        raise ClientGone()
    return item


class Frontend:
    """Everything the HTTP handlers need: sockets, in-flight requests, health, stats."""

    def __init__(self, args: ServerArgs, model_path: str, ipc_dir: str) -> None:
        self.args = args
        self.model_path = model_path
        # the name clients see: --served-model-name, else the model folder's name (never a
        # path; the embedded model's own name, `default_model.served_name`); the folder's name
        # and its path are accepted as well
        folder = model_path.rstrip("/")
        self.model_name = args.served_model_name or served_name(model_path)
        aliases = {model_path, folder}
        if not args.served_model_name:
            aliases.add(os.path.basename(folder))
        # only the served name is ever shown (an unknown model's 404 included; `redact`)
        self.model_names = ModelNames((self.model_name,), aliases)
        self.ipc_dir = ipc_dir
        self.codec = Codec(args.transport != "generic")
        self.ctx = zmq.Context()
        self.inbox = ipc.pull(self.ctx, ipc_dir, ipc.FRONTEND)
        self.to_tok = [
            ipc.push(self.ctx, ipc_dir, name)
            for name in ipc.ingress_names(args.cpu_backend, args.num_tokenizer)
        ]
        self.ready: dict[str, Ready] = {}
        self.ready_cv = threading.Condition()
        self.info: dict[str, Any] = {}
        self.warmup: WarmUpReport | None = None  # replica 0's engine warm-up (set with info)
        self.workers: dict[str, int] = {}  # process name -> pid (set by the launcher)
        self.cpu_backend = args.cpu_backend
        self.sched_stats: dict[str, Any] = {}
        self.reqs: dict[int, ReqState] = {}
        self.timed_out = 0  # requests `fail_after` ended (at shutdown: past --shutdown-timeout)
        self.replicas = Replicas(
            args.dp_size,
            routes=args.cpu_backend != "rust_service",
            workers=worker_names(args.cpu_backend, args.dp_size),
        )
        self.metrics = Metrics()
        # chats with tools: tokenizer loaded on use
        self.renderer = ChatRenderer(model_path, args.chat_template)
        self.reasoning = (  # --reasoning-parser: <think> text as reasoning_content
            None if args.reasoning_parser is None else get_reasoning_format(args.reasoning_parser)
        )
        self.loop: asyncio.AbstractEventLoop | None = None
        self.unhealthy: str | None = None
        self.serving = False
        self.http_stack: dict[str, str] | None = None  # {"loop", "protocol"}: set by the launcher
        self.http_warmup: HttpWarmUp | None = None
        self.gc_frozen: int | None = None  # objects of the start-up heap frozen (serving)
        self.created = int(time.time())
        self._stop = threading.Event()
        self._pending: list = []  # messages received before the loop was attached
        self._fd: int | None = None  # the inbox's descriptor, while the loop reads it
        self._thread = threading.Thread(target=self._recv_loop, name="minisgl-recv", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ inbox
    # Until the event loop runs (the launcher waits for the workers' Ready) a thread reads the
    # inbox; then the loop takes the socket over (`attach_loop`) and reads it when it turns
    # readable: no thread that must take the GIL from a busy loop (each take waited up to the
    # 5 ms switch interval, with a request's first token in the socket meanwhile).
    def _recv_loop(self) -> None:
        while not self._stop.is_set():
            try:
                frames = ipc.drain(self.inbox, RECV_POLL_MS)
            except zmq.ZMQError:
                return
            self._pending.extend(self._decode(frames))

    def _decode(self, frames: list[bytes]) -> list:
        """The frames' messages for `_dispatch` (Ready and Stats are taken here)."""
        msgs = []
        for f in frames:
            try:
                msg = self.codec.decode(f)
            except Exception as e:  # a malformed frame is dropped, never fatal
                logger.warning("rejected a malformed message: %s", e)
                continue
            if isinstance(msg, Ready):
                with self.ready_cv:
                    self.ready[msg.name] = msg
                    self.ready_cv.notify_all()
            elif isinstance(msg, Stats):
                self.sched_stats = self.replicas.on_stats(msg.data)
            else:
                msgs.append(msg)
        return msgs

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: stop the receiver thread, dispatch what it read, read on the loop."""
        self._stop.set()
        self._thread.join()
        self.loop = loop
        msgs, self._pending = self._pending, []
        if msgs:
            self._dispatch(msgs)
        self._fd = self.inbox.getsockopt(zmq.FD)
        loop.add_reader(self._fd, self._on_readable)
        self._on_readable()  # the descriptor is edge-triggered: frames may be queued already

    def _on_readable(self) -> None:
        sock = self.inbox
        try:
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                msgs = self._decode(ipc.take(sock))
                if msgs:
                    self._dispatch(msgs)
        except zmq.ZMQError:  # closed during shutdown
            self._stop_reading()

    def _stop_reading(self) -> None:
        if self.loop is not None and self._fd is not None:
            with contextlib.suppress(Exception):  # the loop may be closed already
                self.loop.remove_reader(self._fd)
            self._fd = None

    def _dispatch(self, msgs: list) -> None:
        now = time.perf_counter()
        for msg in msgs:
            if isinstance(msg, DetokOut):
                lps = msg.logprobs or [None] * len(msg.uids)
                for uid, text, count, fin, ptoks, lp in zip(
                    msg.uids, msg.texts, msg.counts, msg.finished, msg.prompt_tokens, lps,
                    strict=True,
                ):  # fmt: skip
                    st = self.reqs.get(uid)
                    if st is None:
                        continue
                    if st.t_first is None:
                        st.t_first = now
                        trace.mark("api.first", uid, now)
                    st.t_last = now
                    st.prompt_tokens = ptoks
                    st.completion_tokens += count
                    st.mailbox.put_text(st.index, text, fin, lp)
            elif isinstance(msg, Reject):
                st = self.reqs.get(msg.uid)
                if st is not None:
                    err = reject_to_error(msg)
                    err.message = self.redact(err.message)
                    st.mailbox.put(Failure(st.index, err))
            elif isinstance(msg, Admitted):
                uids = msg.uids.tolist()
                reps = msg.replicas.tolist()
                if len(reps) != len(uids):  # a sender that does not say
                    reps = [None] * len(uids)
                for uid, replica in zip(uids, reps, strict=True):
                    st = self.reqs.get(uid)
                    if st is not None:
                        st.replica = replica
                        st.mailbox.put(Accepted(st.index))

    def redact(self, text: str) -> str:
        """`text` with the model path replaced by the served name: a response never shows a
        local path (a worker's error may name the model folder or a file in it)."""
        for path in sorted({self.model_path, self.model_path.rstrip("/")} - {""}, key=len)[::-1]:
            text = text.replace(path, self.model_name)
        return text

    def wait_ready(self, names: list[str], timeout: float, alive) -> dict[str, Ready]:
        """Block until every worker in `names` reported Ready; raise if one failed or died."""
        deadline = time.monotonic() + timeout
        with self.ready_cv:
            while True:
                failed = [r for r in self.ready.values() if r.error]
                if failed:
                    raise ipc.WorkerStartError(f"{failed[0].name} failed to start: "
                                               f"{failed[0].error}")  # fmt: skip
                if all(n in self.ready for n in names):
                    return dict(self.ready)
                dead = alive()
                if dead:
                    raise RuntimeError(f"{dead} exited during startup")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [n for n in names if n not in self.ready]
                    raise TimeoutError(f"workers not ready after {timeout:.0f}s: {missing}")
                self.ready_cv.wait(min(left, 0.2))

    # ------------------------------------------------------------------ health
    def mark_unhealthy(self, reason: str) -> None:
        """Called from the supervisor thread when a worker dies."""
        if self.unhealthy is None:
            self.unhealthy = reason
        loop = self.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.fail_all, reason, 503)

    def replica_down(self, replica: int, reason: str) -> None:
        """Supervisor thread: a replica's worker died; where the API server routed requests
        (python backend), those on it end with a 503 (rust_service: the service ends them)."""
        self.replicas.mark_down(replica, reason)
        loop = self.loop
        if self.replicas.routes and loop is not None:
            gone = f"replica {replica} is down: {reason}"
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.fail_all, gone, 503, replica)

    def fail_after(self, delay_s: float, reason: str) -> None:
        """Thread-safe: in `delay_s` seconds, end every request still in flight with a 503
        (`timed_out`: how many that ended)."""

        def cut() -> None:
            self.timed_out = self.fail_all(reason, 503)

        loop = self.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.call_later, delay_s, cut)

    def fail_all(self, reason: str, status: int = 503, replica: int | None = None) -> int:
        """End the requests in flight (on `replica`) with `status`; returns how many."""
        ended = 0
        for uid, st in list(self.reqs.items()):
            if replica is not None and self.replicas.replica_of(uid) != replica:
                continue
            err = reject_to_error(Reject(uid, reason, status, "service_unavailable"))
            st.mailbox.put(Failure(st.index, err))
            ended += 1
        return ended

    # ------------------------------------------------------------------ requests
    def served(self, job: Job) -> dict[str, int] | None:
        """The response extension naming the replica that serves `job` (`minisgl` in the body):
        None with one replica, or before a replica admitted it."""
        replica = job.replica
        if self.replicas.dp == 1 or replica is None:
            return None
        return {"replica": replica, "replicas": self.replicas.dp}

    def served_headers(self, job: Job) -> dict[str, str]:
        replica = job.replica
        if self.replicas.dp == 1 or replica is None:
            return {}
        return {REPLICA_HEADER: str(replica)}

    def _admission_error(self, n: int) -> APIError | None:
        retry = {"Retry-After": RETRY_AFTER_S}
        if self.unhealthy is not None:
            msg = f"server unhealthy: {self.unhealthy}"
            return APIError(503, msg, None, "service_unavailable", retry)
        if not self.serving:
            return APIError(503, "server is shutting down", None, "service_unavailable", retry)
        if len(self.reqs) + n > self.args.queue_limit:
            self.metrics.count_request("rejected_overload")
            return APIError(
                429,
                f"server overloaded: {len(self.reqs)} requests in flight (limit "
                f"{self.args.queue_limit}); retry later",
                None,
                "rate_limit_exceeded",
                retry,
            )
        return None

    @contextlib.asynccontextmanager
    async def job(
        self, parsed: Parsed, receive: Callable[[], Awaitable[dict]]
    ) -> AsyncIterator[Job]:
        """Admit a request (n choices, one uid each), send it to the tokenizers, yield it
        (watching its connection through `receive`); on every way out, whatever has not
        finished is aborted and released (the in-flight count is exactly what is really in
        flight)."""
        err = self._admission_error(parsed.n)
        if err is not None:
            raise err
        uids = self.replicas.new_uids(parsed.n)
        try:  # encode first: nothing is registered for a body that cannot travel
            frames = [
                self.codec.encode(TokenizeReq(uid, parsed.kind, parsed.prompt, p))
                for uid, p in zip(uids, parsed.choice_params(uids), strict=True)
            ]
        except (ValueError, TypeError, OverflowError) as e:
            raise APIError(400, f"the request cannot be encoded: {e}", None, "invalid_value") from e
        box = Mailbox()
        job = Job([ReqState(uid, i, box) for i, uid in enumerate(uids)], box)
        for st in job.states:
            self.reqs[st.uid] = st
        job.watch(receive)
        try:
            trace.mark("api.sent", uids)  # before the send: the next stage may come first
            for st, frame in zip(job.states, frames, strict=True):
                self.to_tok[st.uid % len(self.to_tok)].send(frame)
            yield job
        finally:
            job.unwatch()
            for st in job.states:
                self.abort(st)

    def abort(self, st: ReqState) -> None:
        """Release a choice that has not finished (no-op for a finished one)."""
        if self.reqs.pop(st.uid, None) is not None and not st.finished:
            st.finished = True
            self.metrics.count_request("aborted")
            with contextlib.suppress(zmq.ZMQError):
                self.to_tok[st.uid % len(self.to_tok)].send(self.codec.encode(AbortReq(st.uid)))

    def settle(self, st: ReqState) -> None:
        """A choice ended on the engine's side (finished or rejected): nothing to abort."""
        st.finished = True
        self.reqs.pop(st.uid, None)

    def complete(self, job: Job, outcome: str) -> None:
        """The request ended (`ok` or `error`): choices still running are aborted."""
        for st in job.states:
            self.abort(st)
        self.metrics.count_request(outcome)
        if outcome != "ok":
            return
        m = self.metrics
        m.generated_tokens += job.completion_tokens
        m.prompt_tokens += job.prompt_tokens
        end = time.perf_counter()
        for st in job.states:
            if st.t_first is not None:
                m.ttft.observe(st.t_first - st.t_start)
                if st.completion_tokens > 1 and st.t_last is not None:
                    m.tpot.observe((st.t_last - st.t_first) / (st.completion_tokens - 1))
            m.e2e.observe(end - st.t_start)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._stop_reading()
        self.ctx.destroy(linger=0)


def reject_to_error(r: Reject) -> APIError:
    headers = {"Retry-After": RETRY_AFTER_S} if r.status in (429, 503) else None
    return APIError(r.status, r.message, r.param, r.code, headers)
