"""Load: 64 concurrent streams, the bounded queue (429 + Retry-After), disconnect aborts."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from minisgl.testing.server import (
    MAX_QUEUED,
    MAX_RUNNING,
    metric,
    metrics,
    running_server,
    wait_kv_clean,
)

LIMIT = MAX_RUNNING + MAX_QUEUED  # 64


async def stream_one(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[int, str, int]:
    body = {
        "prompt": f"request {i}: the quick brown fox",
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, fin, usage = [], None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])
            if c["choices"]:
                text.append(c["choices"][0]["text"])
                fin = c["choices"][0]["finish_reason"] or fin
            if c.get("usage"):
                usage = c["usage"]
    return usage["completion_tokens"], fin, i


def test_64_concurrent_streams(server):
    wait_kv_clean(server)
    before = metric(metrics(server), "minisgl_generated_tokens_total")

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(stream_one(c, i, 4 + i % 13) for i in range(64)))

    results = asyncio.run(asyncio.wait_for(main(), 180))
    assert len(results) == 64
    for n, fin, i in results:
        assert n == 4 + i % 13 and fin == "length", (i, n, fin)
    text = wait_kv_clean(server)
    expected = sum(4 + i % 13 for i in range(64))
    assert metric(text, "minisgl_generated_tokens_total") - before == expected


def test_overload_gets_429_then_recovers(slow_server):
    server = slow_server  # 5 ms per step: the flood always outruns the requests it admits
    wait_kv_clean(server)

    async def main() -> list[httpx.Response]:
        # three times what may be in flight (running + queued), all at once: however fast the
        # requests finish, the ones past the bound are refused, never queued without limit
        limits = httpx.Limits(max_connections=4 * LIMIT)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as c:
            body = {"prompt": "hold", "max_tokens": 60, "ignore_eos": True, "stream": True}
            return await asyncio.gather(
                *(c.post("/v1/completions", json=body) for _ in range(3 * LIMIT))
            )

    replies = asyncio.run(asyncio.wait_for(main(), 120))
    codes = [r.status_code for r in replies]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(200) >= LIMIT  # everything within the bound was served
    refused = [r for r in replies if r.status_code == 429]
    assert refused, "no request was refused past the queue bound"
    extra = refused[0]
    assert extra.headers["retry-after"] == "1"
    assert extra.json()["error"]["type"] == "rate_limit_error"
    text = wait_kv_clean(server)  # every served request finished and returned its pages
    assert metric(text, "minisgl_requests_total", '{outcome="rejected_overload"}') >= 1
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={"prompt": "after", "max_tokens": 3, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.fixture(scope="module")
def slow_server(tiny_model_dir, tmp_path_factory):
    """A server whose engine sleeps 5 ms per step (fault injection): a 250-token request takes
    over a second on any machine, so whether a disconnect is noticed does not depend on speed."""
    with running_server(
        tiny_model_dir("llama"),
        log_dir=tmp_path_factory.mktemp("slow-server-log"),
        env={"MINISGL_FAULT_STEP_DELAY_MS": "5"},
    ) as s:
        yield s


def counts(server) -> tuple[float, float]:
    text = metrics(server)
    aborted = metric(text, "minisgl_requests_total", '{outcome="aborted"}', default=0.0)
    return aborted, metric(text, "minisgl_generated_tokens_total")


def test_client_disconnect_aborts_and_frees_kv(slow_server):
    """A streaming client that leaves mid-stream: aborted, its KV pages freed."""
    wait_kv_clean(slow_server)
    aborted0, gen0 = counts(slow_server)
    body = {"prompt": "disconnect me", "max_tokens": 250, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=slow_server.base_url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: {")
            if got == 2:
                break
    # leaving the block closed the connection mid-stream
    wait_kv_clean(slow_server, timeout=30)
    aborted, gen = counts(slow_server)
    assert aborted - aborted0 == 1
    assert gen - gen0 < 250, "the scheduler kept generating for a client that left"


def test_nonstream_disconnect_aborts(slow_server):
    """A non-streaming client that leaves while its request runs: aborted, nothing leaks."""
    wait_kv_clean(slow_server)
    aborted0, gen0 = counts(slow_server)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=slow_server.base_url, timeout=120) as c:
            body = {"prompt": "gone", "max_tokens": 250, "ignore_eos": True}
            task = asyncio.create_task(c.post("/v1/completions", json=body))
            deadline = time.monotonic() + 30
            while (await c.get("/health")).json()["in_flight"] < 1:
                assert time.monotonic() < deadline, "the request never reached the server"
                await asyncio.sleep(0.005)
            task.cancel()  # the client leaves: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(asyncio.wait_for(main(), 60))
    wait_kv_clean(slow_server, timeout=30)
    aborted, gen = counts(slow_server)
    assert aborted - aborted0 == 1
    assert gen - gen0 < 250, "the request whose client left was completed"


async def _stream(client: httpx.AsyncClient, body: dict, started: asyncio.Event | None) -> dict:
    out = {"finish": None, "error": None, "status": None}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        out["status"] = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            c = json.loads(line[6:])
            if "error" in c:
                out["error"] = c["error"]
                break
            if started is not None:
                started.set()
            if c["choices"]:
                out["finish"] = c["choices"][0]["finish_reason"] or out["finish"]
    return out


def test_poison_request_does_not_hurt_running_streams(slow_server):
    """temperature=1e-40 used to make NaN and fail every running request with 500."""

    async def main():
        async with httpx.AsyncClient(base_url=slow_server.base_url, timeout=120) as c:
            events = [asyncio.Event() for _ in range(8)]
            streams = [
                asyncio.create_task(
                    _stream(
                        c,
                        {
                            "prompt": f"story {i}",
                            "max_tokens": 200,
                            "temperature": 0.8,
                            "seed": i,
                            "ignore_eos": True,
                            "stream": True,
                        },
                        events[i],
                    )
                )
                for i in range(8)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
            poison = await c.post(
                "/v1/completions",
                json={"prompt": "poison", "max_tokens": 8, "temperature": 1e-40},
            )
            overlapped = not any(t.done() for t in streams)  # the 8 streams were still running
            return poison, overlapped, await asyncio.gather(*streams)

    poison, overlapped, results = asyncio.run(main())
    assert poison.status_code == 200, poison.text
    assert poison.json()["usage"]["completion_tokens"] >= 1
    for res in results:
        assert res == {"finish": "length", "error": None, "status": 200}
    assert overlapped
