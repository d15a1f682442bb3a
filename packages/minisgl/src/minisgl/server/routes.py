"""The API server's HTTP face: the routes (completions, chat, `/health`, `/v1/models`,
`/metrics`), the request body's limits, and the ASGI app uvicorn serves (`create_app`).

uvicorn serves `CompletionRoutes`, which hands a POST to a completion endpoint straight to its
handler and everything else to FastAPI (its routes, OpenAPI schema and error handlers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from minisgl.server.auth import ApiKeyGate
from minisgl.server.chat_prompt import Think, render_chat, renders_here
from minisgl.server.frontend import Frontend
from minisgl.server.http_warmup import warm_http
from minisgl.server.openapi import request_bodies
from minisgl.server.protocol import (
    APIError,
    Parsed,
    check_priority,
    parse_chat,
    parse_completion,
)
from minisgl.server.responses import Reply, complete_response, error_response
from minisgl.server.sse import stream_response
from minisgl.tools import ToolFormat
from minisgl.utils.gcfreeze import freeze_startup_heap

# the `code` of an error FastAPI / Starlette answers (an unknown route, a wrong method)
HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed"}


class CompletionRoutes:
    """The ASGI app uvicorn serves: a POST to the completion endpoints goes straight to its
    handler (an `APIError` answered as the app's handler would), everything else through
    FastAPI, whose routes, OpenAPI schema and error handlers stay the same. A request and every
    chunk of its stream passed ~10 middleware layers of FastAPI / Starlette on the way in and
    two wrapping `send`s on the way out: ~a tenth of the API server's CPU under burst-256."""

    def __init__(self, app: FastAPI, routes: dict[str, Callable[[Request], Awaitable[Any]]]):
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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


def create_app(fe: Frontend) -> CompletionRoutes | ApiKeyGate:
    """The app over `fe`: FastAPI's routes and error handlers, the completion POSTs straight to
    their handlers (`CompletionRoutes`), behind the API-key gate when --api-key is set."""
    routes = Routes(fe)
    app = FastAPI(
        title="minisgl",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        lifespan=routes.lifespan,
    )
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(APIError, api_error)
    app.get("/health", response_model=None)(routes.health)
    app.get("/v1/models", response_model=None)(routes.models)
    app.get("/metrics", response_model=None)(routes.metrics)
    bodies = request_bodies(int(fe.info.get("max_seq_len", 1)))
    chat, completions = routes.chat, routes.completions
    app.post("/v1/chat/completions", openapi_extra=bodies["chat"], response_model=None)(chat)
    app.post("/v1/completions", openapi_extra=bodies["completions"], response_model=None)(
        completions
    )
    routes.outer = CompletionRoutes(
        app, {"/v1/chat/completions": chat, "/v1/completions": completions}
    )
    # the warm-up (lifespan) calls `outer`, inside the gate
    return routes.outer if fe.args.api_key is None else ApiKeyGate(routes.outer, fe.args.api_key)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    code = HTTP_ERROR_CODES.get(exc.status_code)
    return error_response(APIError(exc.status_code, str(exc.detail), None, code))


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


class Routes:
    """The app's handlers, over one `Frontend`."""

    def __init__(self, fe: Frontend) -> None:
        self.fe = fe
        self.outer: CompletionRoutes | None = None  # the app the HTTP warm-up calls

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """Serving: the loop reads the inbox, one HTTP warm-up before the first real request,
        the start-up heap frozen; at the end, whatever is in flight gets a 503."""
        fe = self.fe
        fe.attach_loop(asyncio.get_running_loop())
        fe.serving = True
        fe.http_warmup = await warm_http(self.outer, fe.model_name)
        fe.gc_frozen = freeze_startup_heap()
        yield
        fe.serving = False
        fe.fail_all("server is shutting down", 503)

    async def health(self) -> Response | dict:
        fe = self.fe
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

    async def models(self) -> dict:
        fe = self.fe
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

    async def metrics(self) -> Response:
        fe = self.fe
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

    async def chat(self, request: Request) -> Response | dict:
        fe = self.fe
        body = await read_body(request, fe.args.max_request_bytes)
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
        return await self.serve(request, parsed, chat=True, tools=fmt, think=think)

    async def completions(self, request: Request) -> Response | dict:
        fe = self.fe
        body = await read_body(request, fe.args.max_request_bytes)
        parsed = parse_completion(
            body, fe.model_names, fe.info["max_seq_len"], fe.info.get("max_token_chars", 0)
        )
        return await self.serve(request, parsed, chat=False)

    async def serve(
        self,
        request: Request,
        parsed: Parsed,
        chat: bool,
        tools: ToolFormat | None = None,
        think: Think | None = None,
    ) -> Response | dict:
        fe = self.fe
        check_priority(parsed.params, fe.args.scheduling_policy)
        prefix = "chatcmpl-" if chat else "cmpl-"
        rid = prefix + uuid.uuid4().hex[:24]
        reply = Reply(chat, rid, int(time.time()), fe.model_name, tools, think)
        if parsed.stream:
            return await stream_response(fe, request, parsed, reply)
        return await complete_response(fe, request, parsed, reply)


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", None, "request_too_large")


async def read_body(request: Request, limit: int) -> Any:
    """The request's JSON body, at most `limit` bytes (413 past it; 400 for invalid JSON)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large(limit)
        chunks.append(part)
    raw = b"".join(chunks)
    try:
        return json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", None, "invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, ints of > 4300 digits
        raise APIError(
            400, f"the request body is not valid JSON: {e}", None, "invalid_json"
        ) from None
