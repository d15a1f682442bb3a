"""A stream whose body never starts (the client left before the response began) still runs
its cleanup: otherwise its admitted request keeps its in-flight slot for ever."""

from __future__ import annotations

import asyncio
import contextlib

from minisgl.server.streaming import ClosingStreamingResponse


def test_cleanup_runs_when_the_body_never_starts():
    closed: list[str] = []
    started: list[str] = []

    async def body():
        started.append("yes")
        yield b"data: x\n\n"

    async def on_close() -> None:
        closed.append("closed")

    async def gone_send(message) -> None:  # the client vanished before the headers went out
        raise OSError("client disconnected")

    async def receive():
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    resp = ClosingStreamingResponse(body(), on_close=on_close, media_type="text/event-stream")
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "headers": []}

    async def run():
        with contextlib.suppress(Exception):  # starlette reports it as ClientDisconnect
            await resp(scope, receive, gone_send)

    asyncio.run(run())
    assert started == []
    assert closed == ["closed"]


def stream(body) -> tuple[list[dict], list[str]]:
    """Run a stream response over `body()` to its end: the messages sent, the cleanups run."""
    closed: list[str] = []
    sent: list[dict] = []

    async def on_close() -> None:
        closed.append("closed")

    async def send(message) -> None:
        sent.append(message)

    async def receive():
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    resp = ClosingStreamingResponse(body(), on_close=on_close, media_type="text/event-stream")
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "headers": []}
    asyncio.run(resp(scope, receive, send))
    return sent, closed


def test_cleanup_runs_once_after_a_full_stream():
    async def body():
        yield b"data: a\n\n"
        yield b"data: [DONE]\n\n"

    sent, closed = stream(body)
    assert sent[0]["type"] == "http.response.start"
    assert b"".join(m.get("body", b"") for m in sent) == b"data: a\n\ndata: [DONE]\n\n"
    assert closed == ["closed"]


def test_the_stream_leaves_the_connection_to_the_job_watcher():
    """Uvicorn says ASGI 2.3, so starlette's StreamingResponse ran an anyio task group per
    stream that listened for the disconnect itself (and a cancel scope delivered every loop
    turn): a fifth of the API server's CPU under burst-256. The response only sends; the
    request's `Job` watches the connection (one plain task), so `receive` is not the
    response's to call."""
    sent: list[dict] = []

    async def body():
        yield b"data: a\n\n"

    async def on_close() -> None:
        pass

    async def send(message) -> None:
        sent.append(message)

    async def receive():
        raise AssertionError("the response read the connection")

    resp = ClosingStreamingResponse(body(), on_close=on_close, media_type="text/event-stream")
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "headers": []}
    asyncio.run(resp(scope, receive, send))
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 2


def test_the_final_chunk_goes_out_with_the_end_of_the_body():
    """A stream's last bytes ([DONE], with the finish chunk and the usage) and the chunked
    body's terminator are one write: a `FinalChunk` is sent with `more_body: False`."""
    from minisgl.server.streaming import FinalChunk

    async def body():
        yield b"data: a\n\n"
        yield FinalChunk(b"data: b\n\ndata: [DONE]\n\n")

    sent, closed = stream(body)
    bodies = [(m["body"], m["more_body"]) for m in sent[1:]]
    assert bodies == [(b"data: a\n\n", True), (b"data: b\n\ndata: [DONE]\n\n", False)]
    assert type(sent[-1]["body"]) is bytes and closed == ["closed"]
