"""The ASGI app uvicorn serves: completion POSTs go straight to their handlers (past FastAPI's
middleware), everything else (other paths, other methods, lifespan) to the FastAPI app."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI
from starlette.requests import ClientDisconnect

from minisgl.server.protocol import APIError
from minisgl.server.routes import CompletionRoutes


def call(app, method: str, path: str, body: bytes = b"{}") -> list[dict]:
    sent: list[dict] = []
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"host", b"t")], "client": ("127.0.0.1", 1),
        "server": ("t", 80),
    }  # fmt: skip

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def status_and_json(sent: list[dict]) -> tuple[int, dict]:
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


def routes(handler) -> CompletionRoutes:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"via": "fastapi"}

    @app.post("/v1/completions")
    async def through_fastapi():
        return {"via": "fastapi"}

    return CompletionRoutes(app, {"/v1/completions": handler})


def test_a_completion_post_goes_to_its_handler_and_the_rest_to_fastapi():
    async def handler(request):
        return {"via": "direct", "body": await request.json()}

    app = routes(handler)
    assert status_and_json(call(app, "POST", "/v1/completions", b'{"a": 1}')) == (
        200,
        {"via": "direct", "body": {"a": 1}},
    )
    assert status_and_json(call(app, "GET", "/health")) == (200, {"via": "fastapi"})
    assert call(app, "GET", "/v1/completions")[0]["status"] == 405  # FastAPI's answer
    assert call(app, "POST", "/nowhere")[0]["status"] == 404


def test_an_api_error_is_answered_as_the_app_answers_it():
    async def handler(request):
        raise APIError(400, "max_tokens must be positive", "max_tokens", "invalid_value")

    status, body = status_and_json(call(routes(handler), "POST", "/v1/completions"))
    assert status == 400
    assert body["error"]["message"] == "max_tokens must be positive"
    assert body["error"]["param"] == "max_tokens" and body["error"]["code"] == "invalid_value"


def test_a_client_gone_while_its_body_is_read_gets_nothing():
    async def handler(request):
        raise ClientDisconnect()

    assert call(routes(handler), "POST", "/v1/completions") == []
