"""The API server's own warm-up, run in its event loop before it serves.

The first requests a FastAPI / uvicorn server answers import what their paths import lazily:
anyio's asyncio backend (the task group of every `StreamingResponse`), FastAPI's lazily
imported modules, the error handlers. On a 2-core machine that stalled the first streamed
requests by 70-290 ms (`MINISGL_TRACE_DIR`: the gap was `tok.detok -> api.first`). This runs
those paths once through the ASGI app, in process, without reaching a worker: two reads, two
requests refused by validation (400), and a streamed response of its own.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HttpWarmUp:
    ms: float
    steps: list[str]

    def info(self) -> dict[str, Any]:
        return {"ms": self.ms, "steps": self.steps}


async def call(app: Any, method: str, path: str, body: bytes = b"") -> int:
    """One request through the ASGI app, in process; returns the response's status."""
    headers = [(b"host", b"warmup"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": headers, "client": ("127.0.0.1", 0),
        "server": ("warmup", 80),
    }  # fmt: skip
    received = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal received
        if received:  # the body was read: the client stays (never a disconnect)
            await asyncio.sleep(3600)
        received = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])

    await app(scope, receive, send)
    return status


async def warm_http(app: Any, model: str) -> HttpWarmUp:
    """`model`: the served name (a request for another is refused earlier, with a 404)."""
    from minisgl.server.streaming import ClosingStreamingResponse

    t0 = time.perf_counter()
    steps: list[str] = []
    for path in ("/health", "/v1/models"):
        await call(app, "GET", path)
        steps.append(f"GET {path}")
    bad = json.dumps({"model": model, "max_tokens": -1}).encode()
    for path in ("/v1/chat/completions", "/v1/completions"):  # refused before any worker
        steps.append(f"POST {path} {await call(app, 'POST', path, bad)}")

    async def chunks() -> AsyncIterator[bytes]:
        yield b'data: {"warmup": true}\n\n'
        yield b"data: [DONE]\n\n"

    async def on_close() -> None:
        return None

    stream = ClosingStreamingResponse(chunks(), on_close=on_close, media_type="text/event-stream")
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/",
        "headers": [],
        "asgi": {"version": "3.0"},
    }

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)  # no disconnect while it streams
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        return None

    await stream(scope, receive, send)
    steps.append("stream")
    return HttpWarmUp((time.perf_counter() - t0) * 1e3, steps)
