"""The API server process: FastAPI app + the `Frontend` that talks to the workers over ZMQ.

A receiver thread owns the PULL socket (readiness, detokenized outputs, rejections, scheduler
stats) and hands each batch of messages to the event loop in one call. Each request has an
asyncio queue; the handlers validate, admit (bounded), send to the tokenizer that owns the uid
(uid % num_tokenizer) and turn queue items into OpenAI responses or SSE chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl.message.schema import (
    AbortReq,
    Codec,
    DetokOut,
    Ready,
    Reject,
    Stats,
    TokenizeReq,
)
from minisgl.server import ipc
from minisgl.server.args import ServerArgs
from minisgl.server.metrics import Metrics
from minisgl.server.protocol import APIError, Parsed, parse_chat, parse_completion

RETRY_AFTER_S = "1"
DISCONNECT_CHECK_S = 0.1


class ClientGone(Exception):
    """The HTTP client disconnected: the request is aborted."""


@dataclass(eq=False)
class ReqState:
    uid: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_last: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finished: bool = False
    checked: float = field(default_factory=time.monotonic)  # last client-disconnect check


class Frontend:
    """Everything the HTTP handlers need: sockets, in-flight requests, health, stats."""

    def __init__(self, args: ServerArgs, model_path: str, ipc_dir: str) -> None:
        self.args = args
        self.model_path = model_path
        self.model_name = args.served_model_name or model_path
        self.model_names = {self.model_name, os.path.basename(self.model_name.rstrip("/"))}
        self.ipc_dir = ipc_dir
        self.codec = Codec(args.transport != "generic")
        self.ctx = zmq.Context()
        self.inbox = ipc.pull(self.ctx, ipc_dir, ipc.FRONTEND)
        self.to_tok = [
            ipc.push(self.ctx, ipc_dir, ipc.tokenizer_name(i)) for i in range(args.num_tokenizer)
        ]
        self.ready: dict[str, Ready] = {}
        self.ready_cv = threading.Condition()
        self.info: dict[str, Any] = {}
        self.sched_stats: dict[str, Any] = {}
        self.reqs: dict[int, ReqState] = {}
        self.uids = itertools.count(1)
        self.metrics = Metrics()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.unhealthy: str | None = None
        self.serving = False
        self.created = int(time.time())
        self._stop = threading.Event()
        self._pending: list = []  # messages received before the loop was attached
        self._thread = threading.Thread(target=self._recv_loop, name="minisgl-recv", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ receiver thread
    def _recv_loop(self) -> None:
        codec = self.codec
        while not self._stop.is_set():
            try:
                frames = ipc.drain(self.inbox, 100)
            except zmq.ZMQError:
                return
            if not frames:
                continue
            msgs = []
            for f in frames:
                msg = codec.decode(f)
                if isinstance(msg, Ready):
                    with self.ready_cv:
                        self.ready[msg.name] = msg
                        self.ready_cv.notify_all()
                elif isinstance(msg, Stats):
                    self.sched_stats = msg.data
                else:
                    msgs.append(msg)
            if msgs:
                loop = self.loop
                if loop is None:
                    self._pending.extend(msgs)
                else:
                    try:
                        loop.call_soon_threadsafe(self._dispatch, msgs)
                    except RuntimeError:  # loop closed during shutdown
                        return

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        if self._pending:
            msgs, self._pending = self._pending, []
            loop.call_soon_threadsafe(self._dispatch, msgs)

    def _dispatch(self, msgs: list) -> None:
        now = time.perf_counter()
        for msg in msgs:
            if isinstance(msg, DetokOut):
                for uid, text, count, fin, ptoks in zip(
                    msg.uids, msg.texts, msg.counts, msg.finished, msg.prompt_tokens, strict=True
                ):
                    st = self.reqs.get(uid)
                    if st is None:
                        continue
                    if st.t_first is None:
                        st.t_first = now
                    st.t_last = now
                    st.prompt_tokens = ptoks
                    st.completion_tokens += count
                    st.queue.put_nowait(("data", text, fin))
            elif isinstance(msg, Reject):
                st = self.reqs.get(msg.uid)
                if st is not None:
                    st.queue.put_nowait(("error", msg, None))

    def wait_ready(self, names: list[str], timeout: float, alive) -> dict[str, Ready]:
        """Block until every worker in `names` reported Ready; raise if one failed or died."""
        deadline = time.monotonic() + timeout
        with self.ready_cv:
            while True:
                failed = [r for r in self.ready.values() if r.error]
                if failed:
                    raise RuntimeError(f"{failed[0].name} failed to start: {failed[0].error}")
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

    def fail_all(self, reason: str, status: int = 503) -> None:
        for uid, st in list(self.reqs.items()):
            st.queue.put_nowait(("error", Reject(uid, reason, status, "service_unavailable"), None))

    # ------------------------------------------------------------------ requests
    def submit(self, parsed: Parsed) -> ReqState:
        if self.unhealthy is not None:
            raise APIError(
                503,
                f"server unhealthy: {self.unhealthy}",
                None,
                "service_unavailable",
                {"Retry-After": RETRY_AFTER_S},
            )
        if not self.serving:
            raise APIError(
                503,
                "server is shutting down",
                None,
                "service_unavailable",
                {"Retry-After": RETRY_AFTER_S},
            )
        if len(self.reqs) >= self.args.queue_limit:
            self.metrics.count_request("rejected_overload")
            raise APIError(
                429,
                f"server overloaded: {len(self.reqs)} requests in flight (limit "
                f"{self.args.queue_limit}); retry later",
                None,
                "rate_limit_exceeded",
                {"Retry-After": RETRY_AFTER_S},
            )
        uid = next(self.uids)
        st = ReqState(uid)
        self.reqs[uid] = st
        msg = TokenizeReq(uid, parsed.kind, parsed.prompt, parsed.params)
        self.to_tok[uid % len(self.to_tok)].send(self.codec.encode(msg))
        return st

    def abort(self, st: ReqState) -> None:
        if self.reqs.pop(st.uid, None) is not None and not st.finished:
            self.metrics.count_request("aborted")
            with contextlib.suppress(zmq.ZMQError):
                self.to_tok[st.uid % len(self.to_tok)].send(self.codec.encode(AbortReq(st.uid)))

    def complete(self, st: ReqState, outcome: str) -> None:
        st.finished = True
        self.reqs.pop(st.uid, None)
        self.metrics.count_request(outcome)
        if outcome != "ok":
            return
        m = self.metrics
        m.generated_tokens += st.completion_tokens
        m.prompt_tokens += st.prompt_tokens
        end = time.perf_counter()
        if st.t_first is not None:
            m.ttft.observe(st.t_first - st.t_start)
            if st.completion_tokens > 1 and st.t_last is not None:
                m.tpot.observe((st.t_last - st.t_first) / (st.completion_tokens - 1))
        m.e2e.observe(end - st.t_start)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.ctx.destroy(linger=0)


# ----------------------------------------------------------------------------- responses
def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def reject_to_error(r: Reject) -> APIError:
    headers = {"Retry-After": RETRY_AFTER_S} if r.status in (429, 503) else None
    return APIError(r.status, r.message, r.param, r.code, headers)


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def usage(st: ReqState) -> dict:
    return {
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": st.completion_tokens,
        "total_tokens": st.prompt_tokens + st.completion_tokens,
    }


def create_app(fe: Frontend) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        fe.attach_loop(asyncio.get_running_loop())
        fe.serving = True
        yield
        fe.serving = False
        fe.fail_all("server is shutting down", 503)

    app = FastAPI(
        title="minisgl", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
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
        workers = {n: r.pid for n, r in sorted(fe.ready.items())}
        return {"status": "ok", "workers": workers, "in_flight": len(fe.reqs)}

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
        text = fe.metrics.render(
            in_flight=len(fe.reqs), healthy=fe.unhealthy is None, sched=fe.sched_stats
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def read_body(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(
                400, f"the request body is not valid JSON: {e}", None, "invalid_json"
            ) from None

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_body(request)
        parsed = parse_chat(body, fe.model_names, fe.info["max_seq_len"])
        return await serve(request, parsed, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        parsed = parse_completion(body, fe.model_names, fe.info["max_seq_len"])
        return await serve(request, parsed, chat=False)

    async def next_item(request: Request, st: ReqState) -> tuple:
        """The request's next output; raises ClientGone once the client disconnected."""
        while True:
            now = time.monotonic()
            if now - st.checked > DISCONNECT_CHECK_S:  # also while tokens keep flowing
                st.checked = now
                if await request.is_disconnected():
                    raise ClientGone()
            try:
                return await asyncio.wait_for(st.queue.get(), DISCONNECT_CHECK_S)
            except TimeoutError:
                pass

    async def serve(request: Request, parsed: Parsed, chat: bool):
        st = fe.submit(parsed)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = fe.model_name
        try:
            first = await next_item(request, st)
        except ClientGone:
            fe.abort(st)
            return Response(status_code=499)  # nobody reads it
        except BaseException:
            fe.abort(st)
            raise
        if first[0] == "error":
            fe.complete(st, "error")
            return error_response(reject_to_error(first[1]))
        if not parsed.stream:
            text = [first[1]]
            fin = first[2]
            try:
                while fin is None:
                    kind, payload, fin = await next_item(request, st)
                    if kind == "error":
                        fe.complete(st, "error")
                        return error_response(reject_to_error(payload))
                    text.append(payload)
            except ClientGone:
                fe.abort(st)
                return Response(status_code=499)
            except BaseException:
                fe.abort(st)
                raise
            fe.complete(st, "ok")
            content = "".join(text)
            if chat:
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "logprobs": None,
                    "finish_reason": fin,
                }
            else:
                choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": fin}
            return {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage(st),
            }

        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = parsed.include_usage

        def chunk(text: str | None, fin: str | None, role: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": fin}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": fin}
            out = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice],
            }
            if include_usage:
                out["usage"] = None
            return sse(out)

        async def events():
            item = first
            try:
                if chat:
                    yield chunk("", None, role=True)
                while True:
                    kind, payload, fin = item
                    if kind == "error":
                        err = reject_to_error(payload).body()
                        fe.complete(st, "error")
                        yield sse(err)
                        break
                    if payload:
                        yield chunk(payload, None)
                    if fin is not None:
                        yield chunk(None if chat else "", fin)
                        fe.complete(st, "ok")
                        if include_usage:
                            yield sse(
                                {
                                    "id": rid,
                                    "object": obj,
                                    "created": created,
                                    "model": model,
                                    "choices": [],
                                    "usage": usage(st),
                                }
                            )
                        break
                    item = await next_item(request, st)
                yield b"data: [DONE]\n\n"
            except ClientGone:
                return
            finally:
                if not st.finished:
                    fe.abort(st)

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return app
