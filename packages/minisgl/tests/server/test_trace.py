"""Request timelines (`MINISGL_TRACE_DIR`): every process of the server marks the stages a
request passes, and `minisgl.benchmark.trace` turns them into per-request gaps to the first
token that add up to the server's time to first token."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

from minisgl.benchmark import trace as trace_report
from minisgl.testing.server import running_server
from minisgl.utils import trace

CARD = "P1-014"
RED = "online-overhead-tests-fail-before-the-stack-the-timelines-and-the-lean-client-exist"
GREEN = "online-overhead-tests-pass"


STAGES = ["api.sent", "tok.recv", "tok.sent", "eng.add", "eng.step", "eng.out", "tok.out",
          "tok.detok", "api.first"]  # fmt: skip


@pytest.fixture(scope="module")
def traced(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trace")
    env = {trace.ENV: str(out)}
    with running_server(
        tiny_model_dir("llama"), log_dir=tmp_path_factory.mktemp("log"), env=env
    ) as s:
        for i in range(3):
            body = {"model": s.model_dir.name, "prompt": f"hello {i}", "max_tokens": 3,
                    "stream": True}  # fmt: skip
            with httpx.stream("POST", s.base_url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                assert len(lines) >= 2 and lines[-1] == "data: [DONE]"
    yield out  # the server has exited: every process flushed its rows


@pytest.mark.card(CARD, "request-timelines-break-the-time-to-first-token-down-by-stage", RED, GREEN)
def test_every_request_passes_every_stage_in_order(traced):
    report = trace_report.summarize(traced)
    assert report.requests == 3 and report.runs == 1
    assert report.stages == STAGES
    for uid, times in report.timelines.items():
        assert list(times) == STAGES, uid
        values = list(times.values())
        assert values == sorted(values), (uid, times)


@pytest.mark.card(CARD, "request-timelines-break-the-time-to-first-token-down-by-stage", RED, GREEN)
def test_gaps_add_up_to_the_time_to_first_token(traced):
    report = trace_report.summarize(traced)
    total = report.gaps_ms.get("api.sent->api.first", [])
    assert len(total) == report.requests > 0
    parts = [report.gaps_ms.get(f"{a}->{b}", []) for a, b in itertools.pairwise(STAGES)]
    for i in range(len(total)):
        assert sum(p[i] for p in parts) == pytest.approx(total[i], abs=1e-6)
    row = report.to_json()["gaps_ms"]["api.sent->api.first"]
    assert row["n"] == report.requests and 0 < row["p50"] <= row["max"]


@pytest.mark.card(CARD, "request-timelines-break-the-time-to-first-token-down-by-stage", GREEN)
def test_off_by_default_marks_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(trace, "_dir", None)
    trace.mark("api.sent", [1, 2])
    trace.flush()
    assert not trace.enabled() and list(tmp_path.iterdir()) == []


@pytest.mark.card(CARD, "request-timelines-break-the-time-to-first-token-down-by-stage", GREEN)
def test_servers_traced_into_one_folder_keep_their_uids_apart(tmp_path):
    for run, base in ((100, 0.0), (200, 10.0)):  # two servers, both with uid 1
        for pid, stages in ((run, STAGES[:1] + STAGES[-1:]), (run + 1, STAGES[1:-1])):
            rows = [[s, 1, base + 0.001 * STAGES.index(s)] for s in stages]
            (tmp_path / f"trace-{run}-{pid}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in rows)
            )
    report = trace_report.summarize(tmp_path)
    assert report.runs == 2 and report.requests == 2
    assert report.gaps_ms["api.sent->api.first"] == pytest.approx([8.0, 8.0])
