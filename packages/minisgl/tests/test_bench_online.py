"""Online harness against a real server (tiny llama): streaming metrics, JSON, gates."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cardgate.hardware import hardware_key  # the device: cpu:<kind> here

sys.path.insert(0, str(Path(__file__).parent / "server"))
from minisgl.benchmark import harness
from minisgl.benchmark.observations import read_jsonl
from minisgl.testing.server import running_server

SMALL = ["--set", "num_requests=4", "--set", "output_len=5", "--set", "input_len_min=8",
         "--set", "input_len_max=40", "--set", "warmup_requests=1", "--no-progress"]  # fmt: skip

CARD = "P1-014"
RED = "online-overhead-tests-fail-before-the-stack-the-timelines-and-the-lean-client-exist"
GREEN = "online-overhead-tests-pass"


@pytest.fixture(scope="module")
def bench_server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir("llama"), log_dir=tmp_path_factory.mktemp("log")) as s:
        yield s


@pytest.mark.card(
    "P0-001",
    "online-run-against-a-real-server-measures-ttft-tpot-itl-and-e2e-latency",
    "gates-files-evaluated-by-cardgate-s-evaluator-a-miss-fails-naming-the-threshold",
    "cpu-utilization-of-the-server-and-client-processes-recorded",
)
def test_online_run_and_gates(bench_server, tiny_model_dir, tmp_path, capsys):
    gate = tmp_path / "g.yaml"
    gate.write_text(
        "version: 1\ngates:\n  - metric: errors\n    max: 0\n"
        "  - metric: ttft_ms.p99\n    max: 0.001\n"  # impossible: must fail
    )
    out = tmp_path / "online.json"
    rc = harness.main(
        ["online", "--base-url", bench_server.base_url, "--out", str(out), "--gate", str(gate),
         "--model-path", str(tiny_model_dir("llama")), "--server-pid", str(bench_server.proc.pid),
         *SMALL]
    )  # fmt: skip
    assert rc == 1
    err = capsys.readouterr().err
    assert "ttft_ms.p99" in err and "missed by" in err and "errors" not in err
    data = json.loads(out.read_text())
    assert data["kind"] == "online" and data["schema_version"] == 1
    m = data["results"]["online"]["metrics"]
    assert m["completed"] == 4 and m["errors"] == 0
    assert m["output_tokens"] == 20  # ignore_eos: every request streams its 5 tokens
    for key in ("ttft_ms", "e2e_ms"):
        assert m[key]["p50"] is not None and m[key]["p50"] > 0, key
    # TPOT divides by the usage's token count, so every 5-token request has one; never negative
    # (a stream read in one go has its chunks at one timestamp: 0), never above the whole request
    assert m["tpot_ms"]["p50"] is not None and 0 <= m["tpot_ms"]["p50"] <= m["e2e_ms"]["max"]
    # ITL is the gap between two chunks of one stream: a busy server may send a request's 5
    # tokens as one chunk, and a run where every stream is one chunk has no gap to report
    assert m["chunks"] >= m["completed"] and m["tokens_per_chunk"] >= 1
    if m["chunks"] > m["completed"]:  # some stream had two chunks or more: at least one gap
        assert m["itl_ms"]["p50"] is not None
        assert 0 <= m["itl_ms"]["p50"] <= m["e2e_ms"]["max"]
    else:
        assert m["itl_ms"]["p50"] is None
    assert m["ttft_ms"]["p50"] <= m["e2e_ms"]["p50"]
    assert m["cpu"]["server_cpu_pct"] >= 0 and "client_cpu_pct" in m["cpu"]
    assert m["cpu"]["client_cpu_core_frac"] >= 0 and isinstance(m["cpu"]["client_saturated"], bool)
    assert data["client"]["threshold"] == 0.7 and data["client"]["refused"] is False
    assert data["gate_metrics"]["output_tok_s"] == m["output_tok_s"] > 0


def test_online_run_writes_observations(bench_server, tiny_model_dir, tmp_path):
    path = tmp_path / "on.jsonl"
    rc = harness.main(
        ["online", "--base-url", bench_server.base_url, "--model-path",
         str(tiny_model_dir("llama")), "--out", str(tmp_path / "on.json"),
         "--observations", str(path), *SMALL, "--set", "output_len=4", "--repeats", "2"]
    )  # fmt: skip
    assert rc == 0
    observations = read_jsonl(path)
    assert [(o.request_id, o.repeat) for o in observations] == [
        (f"seed-online-{i}", r) for r in (0, 1) for i in range(4)
    ]
    for o in observations:
        assert (o.backend, o.device, o.source) == ("python", hardware_key(), "minisgl-online")
        assert o.error is None and o.output_text and o.output_token_ids is None
        assert o.output_tokens == 4 and o.prompt_tokens > 0  # the server's count (template)
        assert 0 < o.ttft_s <= o.e2e_s and o.e2e_s == pytest.approx(o.ttft_s + sum(o.itl_s))
        assert o.workload_fingerprint is not None
    # greedy decoding: the same text in both repeats
    assert [o.output_text for o in observations[:4]] == [o.output_text for o in observations[4:]]


def test_saturated_client_is_flagged_or_refused(bench_server, tiny_model_dir, tmp_path, capsys):
    """Issue 39: the load generator runs in a process of its own; its CPU over the measured
    window as a fraction of one core is recorded, a run above the threshold is flagged with a
    warning and, with --refuse-saturated-client, fails (exit 3). Threshold 0 forces it."""
    import os

    out = tmp_path / "sat.json"
    rc = harness.main(
        ["online", "--base-url", bench_server.base_url, "--model-path",
         str(tiny_model_dir("llama")), "--out", str(out), *SMALL, "--set", "num_requests=2",
         "--client-saturation-threshold", "0", "--refuse-saturated-client"]
    )  # fmt: skip
    assert rc == 3
    err = capsys.readouterr().err
    assert "client saturated" in err and "refused" in err
    data = json.loads(out.read_text())
    cpu = data["results"]["online"]["repeats"][0]["cpu"]
    assert cpu["client_cpu_core_frac"] == pytest.approx(cpu["client_cpu_s"] / cpu["wall_s"])
    assert cpu["client_cpu_core_frac"] > 0 and cpu["client_saturated"] is True
    assert data["results"]["online"]["metrics"]["cpu"]["client_saturated"] is True
    client = data["client"]
    assert client["saturated"] is True and client["refused"] is True
    assert client["threshold"] == 0.0 and client["saturated_runs"] == ["online#0"]
    assert client["processes"] == 1 and client["pids"] and os.getpid() not in client["pids"]
    assert data["results"]["online"]["metrics"]["completed"] == 2  # the run itself went fine


def test_tpot_divides_by_output_tokens_not_stream_chunks():
    """Issue 39: a server that coalesces tokens into fewer SSE chunks made 'TPOT 11 ms' of
    ~2.75 ms a token. TPOT is (e2e - TTFT) / (output tokens - 1), as vLLM's benchmark."""
    from minisgl.benchmark.offline import request_metrics
    from minisgl.benchmark.profiles import WorkItem

    items = [WorkItem(0, [1, 2, 3], 9), WorkItem(1, [4, 5], 4)]
    chunks = [[1.0, 1.1, 1.2], [2.0, 2.1, 2.2, 2.3]]  # 9 tokens in 3 chunks; 4 in 4
    m = request_metrics(items, chunks, [9, 4], 3.0)
    assert m["tpot_ms"]["max"] == pytest.approx(100.0)  # 0.3 s over 3 tokens after the first
    assert m["tpot_ms"]["mean"] == pytest.approx((25.0 + 100.0) / 2)  # 0.2 s over 8, not 2


@pytest.mark.card(CARD, "a-lean-load-generator-streams-what-the-openai-client-streams", RED, GREEN)
def test_lean_client_streams_what_the_openai_client_streams(bench_server, tiny_model_dir, tmp_path):
    texts, kinds = {}, {}
    for kind in ("openai", "lean"):
        obs = tmp_path / f"{kind}.jsonl"
        out = tmp_path / f"{kind}.json"
        rc = harness.main(
            ["online", "--base-url", bench_server.base_url, "--model-path",
             str(tiny_model_dir("llama")), "--out", str(out), "--observations", str(obs),
             "--client", kind, *SMALL]
        )  # fmt: skip
        assert rc == 0
        data = json.loads(out.read_text())
        kinds[kind] = data["client"].get("kind")
        m = data["results"]["online"]["metrics"]
        assert m["completed"] == 4 and m["errors"] == 0 and m["output_tokens"] == 20
        assert 0 < m["ttft_ms"]["p50"] <= m["e2e_ms"]["p50"]
        observations = read_jsonl(obs)
        texts[kind] = [o.output_text for o in observations]
        assert all(o.output_tokens == 5 and o.prompt_tokens > 0 for o in observations)
    assert kinds == {"openai": "openai", "lean": "lean"}
    assert texts["lean"] == texts["openai"] and all(texts["lean"])


@pytest.mark.card(CARD, "a-lean-load-generator-streams-what-the-openai-client-streams", RED, GREEN)
def test_the_lean_client_is_the_default():
    args = harness.build_parser().parse_args(["online"])
    assert args.client == "lean"
