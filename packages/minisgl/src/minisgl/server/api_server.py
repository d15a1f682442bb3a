"""The API server process: FastAPI app + the `Frontend` that talks to the workers over ZMQ.

A receiver thread owns the PULL socket (readiness, detokenized outputs, rejections, scheduler
stats) and hands each batch of messages to the event loop in one call. Each request has an
asyncio queue; the handlers validate, admit (bounded), send to the tokenizer that owns the uid
(uid % num_tokenizer) and turn queue items into OpenAI responses or SSE chunks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

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
from minisgl.reasoning.formats import NOTHING
from minisgl.server.args import ServerArgs
from minisgl.server.auth import ApiKeyGate
from minisgl.server.chat_prompt import Think, render_chat, renders_here
from minisgl.server.http_warmup import HttpWarmUp, warm_http
from minisgl.server.metrics import Metrics
from minisgl.server.openapi import request_bodies
from minisgl.server.protocol import (
    APIError,
    ModelNames,
    Parsed,
    check_priority,
    parse_chat,
    parse_completion,
)
from minisgl.server.replicas import Replicas, worker_names
from minisgl.server.streaming import ClosingStreamingResponse, FinalChunk
from minisgl.tools import (
    ArgsDelta,
    CallStart,
    ContentDelta,
    Event,
    ToolCallParser,
    ToolFormat,
    parse_tool_calls,
)
from minisgl.tools.render import ChatRenderer
from minisgl.utils import trace
from minisgl.utils.gcfreeze import freeze_startup_heap
from minisgl.utils.log import get_logger

logger = get_logger(__name__)

RETRY_AFTER_S = "1"
RECV_POLL_MS = 20  # the receiver thread's poll before serving (how long attach_loop may wait)
# dp > 1: the replica that admitted a request, a server extension strict OpenAI clients ignore
# (the body's / the stream's last chunks' `minisgl` object, and this header)
REPLICA_HEADER = "X-Minisgl-Replica"


class ClientGone(Exception):
    """The HTTP client disconnected: the request is aborted."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """New text of one choice (`finish`: its finish reason once it ended)."""

    index: int
    text: str
    finish: str | None
    logprobs: list | None = None  # [[token, logprob, [[token, logprob], ...]], ...]


@dataclass(frozen=True, slots=True)
class Failure:
    """One choice failed (bad prompt, engine error, worker gone, shutdown)."""

    index: int
    error: APIError


@dataclass(frozen=True, slots=True)
class Accepted:
    """One choice passed validation and is queued in the scheduler."""

    index: int


Item = Chunk | Failure | Accepted


class _Text:
    """A choice's unread new text in a mailbox (parts joined when read)."""

    __slots__ = ("finish", "index", "logprobs", "parts")

    def __init__(self, index: int, text: str, finish: str | None, logprobs: list | None) -> None:
        self.index = index
        self.parts = [text]
        self.finish = finish
        self.logprobs = list(logprobs) if logprobs else None

    def chunk(self) -> Chunk:
        text = self.parts[0] if len(self.parts) == 1 else "".join(self.parts)
        return Chunk(self.index, text, self.finish, self.logprobs)


class Gone:
    """Put in a job's mailbox when its client disconnected: wakes the waiting handler."""


GONE = Gone()


class Mailbox:
    """A job's outputs in arrival order, for its one handler. A choice's new text merges into
    the choice's unread chunk when that is the last item (a handler that fell behind sends one
    SSE event for what accumulated; never past a finish), and the waiting handler is woken once
    however many rows arrived meanwhile: no object, queue put or wake-up per row."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None

    def __bool__(self) -> bool:
        return bool(self.items)

    def put(self, item: Item | Gone) -> None:
        self.items.append(item)
        self._wake()

    def put_text(self, index: int, text: str, finish: str | None, logprobs: list | None) -> None:
        items = self.items
        last = items[-1] if items else None
        if type(last) is _Text and last.index == index and last.finish is None:
            last.parts.append(text)
            last.finish = finish
            if logprobs:
                if last.logprobs is None:
                    last.logprobs = []
                last.logprobs.extend(logprobs)
            return  # unread: its handler is awake already
        items.append(_Text(index, text, finish, logprobs))
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():  # a cancelled wait
                w.set_result(None)

    def pop(self) -> Item | Gone:
        item = self.items.popleft()
        return item.chunk() if type(item) is _Text else item

    async def wait(self) -> None:
        """Until an item is there (returns at once if one is)."""
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter


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


# ----------------------------------------------------------------------------- responses
def error_response(e: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    """`headers`: added to the error's own (the replica of a request that failed on one)."""
    merged = {**(e.headers or {}), **(headers or {})} or None
    return JSONResponse(e.body(), status_code=e.status, headers=merged)


def reject_to_error(r: Reject) -> APIError:
    headers = {"Retry-After": RETRY_AFTER_S} if r.status in (429, 503) else None
    return APIError(r.status, r.message, r.param, r.code, headers)


def sse(obj: Any) -> bytes:
    """One `data:` event. orjson: ~10x faster than `json.dumps` for a chunk (0.7 vs 6.7 us);
    the same bytes for ASCII text, UTF-8 (not `\\u` escapes) otherwise; a non-finite float
    becomes null, never invalid JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage(job: Job) -> dict:
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.completion_tokens,
        "total_tokens": job.prompt_tokens + job.completion_tokens,
    }


def chat_logprobs(entries: list) -> dict:
    def one(tok: str, lp: float) -> dict:
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8", "replace"))}

    return {"content": [{**one(t, lp), "top_logprobs": [one(*x) for x in top]}
                        for t, lp, top in entries]}  # fmt: skip


def completion_logprobs(entries: list, offset: int) -> dict:
    """OpenAI's legacy shape; `offset`: characters of this choice's text before these tokens."""
    offsets = []
    for t, _, _ in entries:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": [t for t, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [dict(top) for _, _, top in entries],
        "text_offset": offsets,
    }


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


@dataclass(frozen=True)
class Reply:
    """What every response of one request shares (`tools`: the format its tool calls are
    parsed in; None when the request has no tools or tool_choice is "none")."""

    chat: bool
    id: str
    created: int
    model: str
    tools: ToolFormat | None = None
    think: Think | None = None  # --reasoning-parser: how the outputs split

    def error(self, e: APIError) -> APIError:
        """The engine names the prompt 'prompt'; on the chat endpoint it is 'messages'."""
        if self.chat and e.param == "prompt":
            return APIError(e.status, e.message, "messages", e.code, e.headers)
        return e

    def envelope(self, choices: list, obj: str) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


async def complete_response(fe: Frontend, request: Request, parsed: Parsed, reply: Reply):
    async with fe.job(parsed, request.receive) as job:
        texts: list[list[str]] = [[] for _ in job.states]
        want_lp = parsed.params.logprobs is not None
        lps: list[list | None] = [[] if want_lp else None for _ in job.states]
        finish: list[str | None] = [None] * len(job.states)
        left = len(job.states)
        try:
            while left:
                item = await next_item(job)
                if isinstance(item, Accepted):
                    continue
                st = job.states[item.index]
                if isinstance(item, Failure):
                    fe.settle(st)
                    fe.complete(job, "error")
                    return error_response(reply.error(item.error), fe.served_headers(job))
                texts[item.index].append(item.text)
                if item.logprobs and lps[item.index] is not None:
                    lps[item.index].extend(item.logprobs)
                if item.finish is not None:
                    finish[item.index] = item.finish
                    fe.settle(st)
                    left -= 1
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the job context aborts
        fe.complete(job, "ok")
    choices = []
    for i, parts in enumerate(texts):
        content = "".join(parts)
        lp = lps[i]
        if reply.chat:
            reasoning = None
            if reply.think is not None:
                reasoning, content = reply.think.split(content)
            msg, fin = assistant_message(reply.tools, content, finish[i])
            if reply.think is not None:
                msg["reasoning_content"] = reasoning
            lp = None if lp is None else chat_logprobs(lp)
            choices.append({"index": i, "message": msg, "logprobs": lp, "finish_reason": fin})
        else:
            lp = None if lp is None else completion_logprobs(lp, 0)
            choices.append(
                {"index": i, "text": content, "logprobs": lp, "finish_reason": finish[i]}
            )
    out = reply.envelope(choices, "chat.completion" if reply.chat else "text_completion")
    out["usage"] = usage(job)
    served = fe.served(job)
    if served is None:
        return out
    out["minisgl"] = served
    return JSONResponse(out, headers=fe.served_headers(job))


def assistant_message(
    fmt: ToolFormat | None, content: str, finish: str | None
) -> tuple[dict, str | None]:
    """The chat message of a whole answer and its finish reason (tool calls parsed out)."""
    calls = parse_tool_calls(fmt, content) if fmt is not None else None
    if calls is None or not calls.calls:
        return {"role": "assistant", "content": content}, finish
    msg = {
        "role": "assistant",
        "content": calls.content,
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls.calls
        ],
    }
    return msg, "tool_calls" if finish == "stop" else finish


def event_delta(ev: Event) -> dict:
    """A tool-call parser event as an OpenAI stream delta."""
    if isinstance(ev, ContentDelta):
        return {"content": ev.text}
    if isinstance(ev, CallStart):
        call = {"index": ev.index, "id": ev.id, "type": "function",
                "function": {"name": ev.name, "arguments": ""}}  # fmt: skip
        return {"tool_calls": [call]}
    assert isinstance(ev, ArgsDelta)
    return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}


async def stream_response(fe: Frontend, request: Request, parsed: Parsed, reply: Reply):
    obj = "chat.completion.chunk" if reply.chat else "text_completion"
    include_usage = parsed.include_usage
    stack = contextlib.AsyncExitStack()  # closed by events(), or here if no stream starts
    # admission errors: plain 4xx/5xx
    job = await stack.enter_async_context(fe.job(parsed, request.receive))
    try:  # errors found before admission (tokenization, context length) stay plain 4xx too;
        # the stream starts once the scheduler queued the request, not at its first token
        first = await next_item(job)
        if isinstance(first, Failure):
            fe.settle(job.states[first.index])
            fe.complete(job, "error")
            await stack.aclose()
            return error_response(reply.error(first.error))
    except ClientGone:
        await stack.aclose()
        return Response(status_code=499)
    except BaseException:
        await stack.aclose()
        raise

    offsets = [0] * len(job.states)  # completions: characters sent per choice

    parsers = [ToolCallParser(reply.tools) if reply.tools else None for _ in job.states]
    thinks = [reply.think.stream() if reply.think else None for _ in job.states]
    called = [False] * len(job.states)

    def chunk(
        index: int,
        text: str | None,
        fin: str | None,
        role: bool = False,
        lp: list | None = None,
        tool: dict | None = None,
    ) -> bytes:
        if reply.chat:
            delta: dict[str, Any] = dict(tool or {})
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            lps = chat_logprobs(lp) if lp else None
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": fin}
        else:
            lps = completion_logprobs(lp, offsets[index]) if lp else None
            offsets[index] += len(text or "")
            choice = {"index": index, "text": text or "", "logprobs": lps, "finish_reason": fin}
        out = reply.envelope([choice], obj)
        if parsed.continuous_usage:
            out["usage"] = usage(job)
        elif include_usage:
            out["usage"] = None
        if fin is not None:  # a choice's last chunk names the replica (dp > 1)
            served = fe.served(job)
            if served is not None:
                out["minisgl"] = served
        return sse(out)

    async def events():
        item: Item = first
        left = len(job.states)
        # only `data:` lines: peer clients json.loads every non-empty line (the headers go out
        # as the response starts, once the scheduler queued the request). What one output adds
        # goes out in one write: the role chunks with the first text, a choice's finish chunk
        # with its last text, the usage, [DONE] and the body's end with the last one. The role
        # chunks are made with the first output, which says the prompt's length (their usage,
        # stream_options.continuous_usage_stats, counts it).
        roles = reply.chat
        out: list[bytes] = []
        try:
            while True:
                st = job.states[item.index]
                if isinstance(item, Accepted):
                    item = await next_item(job)
                    continue
                if roles:
                    out = [chunk(s.index, "", None, role=True) for s in job.states]
                    roles = False
                if isinstance(item, Failure):
                    fe.settle(st)
                    fe.complete(job, "error")
                    out.append(sse(reply.error(item.error).body()))
                    break
                text, lp = item.text, item.logprobs
                think = thinks[item.index]
                if think is not None:  # the reasoning first; the rest is the content
                    reasoning, text = think.feed(text) if text else NOTHING
                    if item.finish is not None:
                        more = think.finish()
                        reasoning, text = reasoning + more.reasoning, text + more.content
                    if reasoning:
                        out.append(chunk(item.index, None, None, lp=lp,
                                         tool={"reasoning_content": reasoning}))  # fmt: skip
                        lp = None
                parser = parsers[item.index]
                if parser is not None:  # tool calls: parser events, logprobs on the first
                    events = parser.feed(text) if text else []
                    if item.finish is not None:
                        events += parser.finish()
                    for ev in events:
                        called[item.index] |= isinstance(ev, CallStart)
                        out.append(chunk(item.index, None, None, lp=lp, tool=event_delta(ev)))
                        lp = None
                    if lp:
                        out.append(chunk(item.index, None, None, lp=lp))
                elif text or lp:
                    out.append(chunk(item.index, text, None, lp=lp))
                if item.finish is not None:
                    fe.settle(st)
                    fin = item.finish
                    if called[item.index] and fin == "stop":
                        fin = "tool_calls"
                    out.append(chunk(item.index, None if reply.chat else "", fin))
                    left -= 1
                    if not left:
                        fe.complete(job, "ok")
                        if include_usage:
                            usage_out = reply.envelope([], obj)
                            usage_out["usage"] = usage(job)
                            served = fe.served(job)
                            if served is not None:
                                usage_out["minisgl"] = served
                            out.append(sse(usage_out))
                        break
                if out:
                    yield b"".join(out)
                    out = []
                item = await next_item(job)
            out.append(b"data: [DONE]\n\n")
            yield FinalChunk(b"".join(out))
        except ClientGone:
            return
        finally:
            await stack.aclose()

    return ClosingStreamingResponse(
        events(),
        on_close=stack.aclose,
        media_type="text/event-stream",
        # the replica is known here: the stream starts once the scheduler queued the request
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **fe.served_headers(job)},
    )


class CompletionRoutes:
    """The ASGI app uvicorn serves: a POST to the completion endpoints goes straight to its
    handler (an `APIError` answered as the app's handler would), everything else through
    FastAPI, whose routes, OpenAPI schema and error handlers stay the same. A request and every
    chunk of its stream passed ~10 middleware layers of FastAPI / Starlette on the way in and
    two wrapping `send`s on the way out: ~a tenth of the API server's CPU under burst-256."""

    def __init__(self, app: FastAPI, routes: dict[str, Callable[[Request], Awaitable[Any]]]):
        self.app = app
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            response = await handler(Request(scope, receive))
        except APIError as e:
            response = error_response(e)
        except ClientDisconnect:  # gone while its body was read: nobody to answer
            return
        if not isinstance(response, Response):
            response = JSONResponse(response)
        await response(scope, receive, send)


# the `code` of an error FastAPI / Starlette answers (an unknown route, a wrong method)
HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed"}


def create_app(fe: Frontend) -> CompletionRoutes | ApiKeyGate:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        fe.attach_loop(asyncio.get_running_loop())
        fe.serving = True
        fe.http_warmup = await warm_http(outer, fe.model_name)  # before the first real request
        fe.gc_frozen = freeze_startup_heap()
        yield
        fe.serving = False
        fe.fail_all("server is shutting down", 503)

    app = FastAPI(
        title="minisgl",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        lifespan=lifespan,
    )
    bodies = request_bodies(int(fe.info.get("max_seq_len", 1)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = HTTP_ERROR_CODES.get(exc.status_code)
        return error_response(APIError(exc.status_code, str(exc.detail), None, code))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.get("/health")
    async def health():
        if fe.unhealthy is not None:
            return JSONResponse({"status": "unhealthy", "reason": fe.unhealthy}, status_code=503)
        if not fe.serving:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        workers = fe.workers or {n: r.pid for n, r in sorted(fe.ready.items())}
        return {
            "status": "ok",
            "workers": workers,
            "in_flight": len(fe.reqs),
            "cpu_backend": fe.cpu_backend,
            "replicas": fe.replicas.view(),
            "warmup": None if fe.warmup is None else fe.warmup.info(),
            "gc_frozen": {
                "api_server": fe.gc_frozen,
                **{n: r.info.get("gc_frozen") for n, r in sorted(fe.ready.items())},
            },
            "http": {
                **(fe.http_stack or {}),
                "warmup": None if fe.http_warmup is None else fe.http_warmup.info(),
            },
        }

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": fe.model_name,
                    "object": "model",
                    "created": fe.created,
                    "owned_by": "minisgl",
                    "max_model_len": fe.info.get("max_seq_len"),
                }
            ],
        }

    @app.get("/metrics")
    async def metrics():
        text = (
            fe.metrics.render(
                in_flight=len(fe.reqs),
                healthy=fe.unhealthy is None,
                sched=fe.sched_stats,
                warmup=fe.warmup,
            )
            + fe.replicas.render()
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def read_body(request: Request) -> Any:
        limit = fe.args.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(
                413, f"the request body exceeds {limit} bytes", None, "request_too_large"
            )
        chunks, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise APIError(
                    413, f"the request body exceeds {limit} bytes", None, "request_too_large"
                )
            chunks.append(part)
        raw = b"".join(chunks)
        try:
            return json.loads(raw)
        except RecursionError:
            raise APIError(
                400, "the request body is nested too deeply", None, "invalid_json"
            ) from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, ints of > 4300 digits
            raise APIError(
                400, f"the request body is not valid JSON: {e}", None, "invalid_json"
            ) from None

    @app.post("/v1/chat/completions", openapi_extra=bodies["chat"])
    async def chat(request: Request):
        body = await read_body(request)
        parsed = parse_chat(
            body, fe.model_names, fe.info["max_seq_len"], fe.info.get("max_token_chars", 0)
        )
        fmt = think = None
        if renders_here(parsed, fe.reasoning):
            try:
                parsed, fmt, think = await asyncio.to_thread(
                    render_chat, fe.renderer, parsed, fe.reasoning
                )
            except APIError as e:  # the template's or the tokenizer's error: never the path
                e.message = fe.redact(e.message)
                raise
        return await serve(request, parsed, chat=True, tools=fmt, think=think)

    @app.post("/v1/completions", openapi_extra=bodies["completions"])
    async def completions(request: Request):
        body = await read_body(request)
        parsed = parse_completion(
            body, fe.model_names, fe.info["max_seq_len"], fe.info.get("max_token_chars", 0)
        )
        return await serve(request, parsed, chat=False)

    async def serve(
        request: Request,
        parsed: Parsed,
        chat: bool,
        tools: ToolFormat | None = None,
        think: Think | None = None,
    ):
        check_priority(parsed.params, fe.args.scheduling_policy)
        prefix = "chatcmpl-" if chat else "cmpl-"
        rid = prefix + uuid.uuid4().hex[:24]
        reply = Reply(chat, rid, int(time.time()), fe.model_name, tools, think)
        if parsed.stream:
            return await stream_response(fe, request, parsed, reply)
        return await complete_response(fe, request, parsed, reply)

    outer = CompletionRoutes(app, {"/v1/chat/completions": chat, "/v1/completions": completions})
    # the warm-up (lifespan) calls `outer`, inside the gate
    return outer if fe.args.api_key is None else ApiKeyGate(outer, fe.args.api_key)
