"""The online benchmark opens the connections its measured requests use before it measures:
no measured request pays a TCP handshake or the server's new-connection path (issue 39:
"warm every arm before timing"). Written after the change (an experiment first showed TTFT p50
on seed-online 21.1 -> 17.4 ms python, 19.9 -> 13.6 ms rust_service)."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from minisgl.benchmark import online
from minisgl.benchmark.profiles import build_workload, get_profile
from minisgl.benchmark.report import Progress
from minisgl.benchmark.sse import Usage


class Recorder:
    """A client that records what the benchmark asked of it, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    async def __aenter__(self) -> Recorder:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def connect(self, n: int) -> None:
        self.events.append(("connect", n))

    async def chat(self, body, t0, times, parts, served=None) -> Usage:
        self.events.append(("chat", body["max_tokens"]))
        times.append(0.001)
        parts.append("x")
        return Usage(8, 1)


@pytest.mark.parametrize(("profile", "sets", "want"), [
    ("seed-online", {}, 8),  # concurrency 8
    ("seed-online", {"num_requests": "3"}, 3),  # never more than the requests
    ("burst-256", {"num_requests": "40"}, 40),  # concurrency 256, 40 requests
])  # fmt: skip
def test_the_measured_requests_connections_open_before_the_warmup(monkeypatch, profile, sets,
                                                                   want):  # fmt: skip
    prof = get_profile(profile, sets)
    items = build_workload(prof, 1000)
    prep = online.PreparedRun("m", "tok", items, [[{"role": "user", "content": "hi"}]] * len(items))
    rec = Recorder()
    monkeypatch.setattr(online, "make_client", lambda args: rec)
    args = argparse.Namespace(base_url="http://127.0.0.1:1", api_key="k", timeout=5.0,
                              server_pid=None, observations=None)  # fmt: skip
    asyncio.run(online._run(args, prof, prep, Progress(False)))
    assert rec.events[0] == ("connect", want)
    warm = min(prof.warmup_requests, len(items))
    assert [e for e, _ in rec.events[1:]] == ["chat"] * (warm + len(items))
    assert all(n == 4 for _, n in rec.events[1 : 1 + warm])  # the warm-up's short requests
