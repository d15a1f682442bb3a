"""Issue 39: the engine worker's KV integrity check (O(pool): every page's owner, and the
prefix cache's indices through `np.unique`) never delays a request.

It ran at the idle edge, the moment the last request finished: a request arriving right after
(a benchmark's measured burst after its warm-up, a client's next turn) waited behind ~5 ms of
numpy on a 115k-page pool, and more with a full prefix cache. Now the check runs once the
engine has been idle for `QUIET_CHECK_S`; until then the stats say the check is pending
(`integrity_pending`, the `minisgl_kv_integrity_pending` gauge) so a caller that waits for a
clean pool (`wait_kv_clean`) waits for a check that saw the pool after its last request."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minisgl import LLM
from minisgl.message.schema import AddReq, Codec, Stats, WireParams
from minisgl.server import engine_worker
from minisgl.server.engine_worker import EngineLoop

KW = dict(dtype="float32", num_pages=256, max_seq_len_override=64, max_running_requests=4,
          max_extend_tokens=64, overlap=False)  # fmt: skip


class Sink:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def send(self, frame: bytes) -> None:
        self.frames.append(frame)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    from minisgl.testing.tiny_models import write_tiny_model

    path: Path = write_tiny_model("llama", tmp_path_factory.mktemp("idle-llama"), seed=0)
    llm = LLM(path, **KW)
    yield llm
    llm.close()


@pytest.fixture
def loop(llm, monkeypatch: pytest.MonkeyPatch):
    clock = Clock()
    monkeypatch.setattr(engine_worker.time, "monotonic", clock)
    checks: list[float] = []
    sched = llm.runtime.scheduler
    orig = sched.check_integrity

    def counted() -> None:
        checks.append(clock.t)
        orig()

    monkeypatch.setattr(sched, "check_integrity", counted)
    codec, front = Codec(True), Sink()
    lp = EngineLoop(llm.runtime, codec, [Sink()], front)
    lp.maybe_send_stats(force=True)  # as the worker does once ready
    checks.clear()
    front.frames.clear()
    return lp, clock, checks, front, codec


def serve_one(lp: EngineLoop, uid: int) -> None:
    rng = np.random.default_rng(uid)
    ids = rng.integers(3, 300, size=20).astype(np.int32)
    lp.handle(AddReq(uid, ids, WireParams(max_tokens=4, ignore_eos=True)))
    lp.flush_admitted()
    for _ in range(100):
        if not lp.rt.has_work():
            break
        lp.step()
        lp.maybe_send_stats()
    assert not lp.rt.has_work()


def last_stats(front: Sink, codec: Codec) -> dict:
    msgs = [codec.decode(f) for f in front.frames]
    stats = [m for m in msgs if isinstance(m, Stats)]
    assert stats, "no stats were sent"
    return stats[-1].data


def test_the_idle_edge_sends_stats_without_the_check(loop) -> None:
    lp, _clock, checks, front, codec = loop
    serve_one(lp, 1)
    lp.maybe_send_stats()  # the idle edge: the last request just finished
    assert checks == [], "the integrity check ran at the idle edge, where a request may arrive"
    data = last_stats(front, codec)
    assert data["integrity_pending"] == 1 and data["running"] == 0


def test_the_check_runs_once_the_engine_stayed_idle(loop) -> None:
    lp, clock, checks, front, codec = loop
    serve_one(lp, 2)
    lp.maybe_send_stats()
    clock.t += engine_worker.QUIET_CHECK_S / 2
    lp.maybe_send_stats()
    assert checks == []
    clock.t += engine_worker.QUIET_CHECK_S
    lp.maybe_send_stats()
    assert len(checks) == 1
    data = last_stats(front, codec)
    assert data["integrity_pending"] == 0 and data["integrity_ok"] == 1
    for _ in range(5):  # idle on: no check again until new work
        clock.t += engine_worker.STATS_IDLE_S
        lp.maybe_send_stats()
    assert len(checks) == 1
    serve_one(lp, 3)
    lp.maybe_send_stats()
    assert last_stats(front, codec)["integrity_pending"] == 1
    clock.t += engine_worker.QUIET_CHECK_S
    lp.maybe_send_stats()
    assert len(checks) == 2 and last_stats(front, codec)["integrity_pending"] == 0


def test_a_leak_found_by_the_deferred_check_is_reported(loop) -> None:
    lp, clock, checks, front, codec = loop
    serve_one(lp, 4)
    lp.maybe_send_stats()
    alloc = lp.sched.alloc
    leaked = alloc._free_pages.pop()  # a page nobody owns
    try:
        clock.t += engine_worker.QUIET_CHECK_S
        lp.maybe_send_stats()
        data = last_stats(front, codec)
        assert len(checks) == 1 and data["integrity_ok"] == 0 and data["integrity_pending"] == 0
    finally:
        alloc._free_pages.append(leaked)
    serve_one(lp, 5)
    clock.t += engine_worker.QUIET_CHECK_S
    lp.maybe_send_stats()
    lp.maybe_send_stats()
    assert last_stats(front, codec)["integrity_ok"] == 1


def test_metrics_render_the_pending_check() -> None:
    from minisgl.server.metrics import Metrics

    text = Metrics().render(in_flight=0, healthy=True, sched={"integrity_pending": 1},
                            warmup=None)  # fmt: skip
    assert "minisgl_kv_integrity_pending 1" in text
