"""Load: 64 concurrent streams, the bounded queue (429 + Retry-After), disconnect aborts."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
from server_harness import MAX_QUEUED, MAX_RUNNING

LIMIT = MAX_RUNNING + MAX_QUEUED  # 64


def metric(text: str, name: str, labels: str = "", default: float | None = None) -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    if m is None and default is not None:  # a labelled counter appears at its first event
        return default
    assert m, f"{name}{labels} missing"
    return float(m.group(1))


def metrics(server) -> str:
    return httpx.get(server.base_url + "/metrics", timeout=10).text


def wait_kv_clean(server, timeout: float = 30.0) -> str:
    """Until nothing runs and every used page belongs to the prefix cache (no leak)."""
    deadline = time.monotonic() + timeout
    while True:
        text = metrics(server)
        running = metric(text, "minisgl_num_running_requests")
        queued = metric(text, "minisgl_num_queued_requests")
        used = metric(text, "minisgl_kv_pages_used")
        cached = metric(text, "minisgl_kv_pages_cached")
        inflight = metric(text, "minisgl_requests_in_flight")
        ok = metric(text, "minisgl_kv_integrity_ok")
        if running == queued == inflight == 0 and used == cached and ok == 1:
            return text
        if time.monotonic() > deadline:
            raise AssertionError(
                f"KV not clean: running={running} queued={queued} "
                f"used={used} cached={cached} in_flight={inflight} ok={ok}"
            )
        time.sleep(0.1)


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


def test_overload_gets_429_then_recovers(server):
    wait_kv_clean(server)

    async def main() -> list[httpx.Response]:
        # three times what may be in flight (running + queued), all at once: however fast the
        # requests finish, the ones past the bound are refused, never queued without limit
        limits = httpx.Limits(max_connections=4 * LIMIT)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as c:
            body = {"prompt": "hold", "max_tokens": 240, "ignore_eos": True, "stream": True}
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


def test_client_disconnect_aborts_and_frees_kv(server):
    wait_kv_clean(server)
    text = metrics(server)
    gen0 = metric(text, "minisgl_generated_tokens_total")
    body = {"prompt": "disconnect me", "max_tokens": 250, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.base_url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: {"):
                got += 1
            if got == 2:
                break
    # leaving the block closes the connection mid-stream
    after = wait_kv_clean(server, timeout=15)
    assert metric(after, "minisgl_requests_total", '{outcome="aborted"}') >= 1
    generated = metric(after, "minisgl_generated_tokens_total") - gen0
    assert generated < 250, "the scheduler kept generating for a client that left"


def test_nonstream_disconnect_aborts(server):
    """A non-streaming client that leaves while its request waits: aborted, nothing leaks."""
    wait_kv_clean(server)
    n_hold, hold_tokens = 2 * MAX_RUNNING, 250

    async def main() -> tuple[str, str]:
        before = metrics(server)
        limits = httpx.Limits(max_connections=4 * MAX_RUNNING)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as c:

            async def in_flight_at_least(n: int) -> None:
                deadline = time.monotonic() + 30
                while (await c.get("/health")).json()["in_flight"] < n:
                    assert time.monotonic() < deadline, f"never {n} requests in flight"
                    await asyncio.sleep(0.002)

            # holders fill every running slot and a queue behind them: thousands of tokens of
            # work ahead of the request, so it is still waiting when its client leaves
            hold = {"prompt": "hold", "max_tokens": hold_tokens, "ignore_eos": True}
            holders = [asyncio.create_task(c.post("/v1/completions", json=hold))
                       for _ in range(n_hold)]  # fmt: skip
            await in_flight_at_least(n_hold)
            gone = {"prompt": "gone", "max_tokens": 250, "ignore_eos": True}
            task = asyncio.create_task(c.post("/v1/completions", json=gone))
            await in_flight_at_least(n_hold + 1)
            task.cancel()  # the client leaves: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await task
            replies = await asyncio.gather(*holders)
            assert all(r.status_code == 200 for r in replies)
        return before, wait_kv_clean(server, timeout=30)

    before, after = asyncio.run(asyncio.wait_for(main(), 120))
    aborted = '{outcome="aborted"}'
    assert (
        metric(after, "minisgl_requests_total", aborted)
        - metric(before, "minisgl_requests_total", aborted, default=0.0)
        == 1
    )
    generated = metric(after, "minisgl_generated_tokens_total") - metric(
        before, "minisgl_generated_tokens_total"
    )
    assert generated - n_hold * hold_tokens < 250, "the request that was left was completed"
