"""Online harness against a real server (tiny llama): streaming metrics, JSON, gates."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "server"))
from minisgl.benchmark import harness
from minisgl.testing.server import running_server

SMALL = ["--set", "num_requests=4", "--set", "output_len=5", "--set", "input_len_min=8",
         "--set", "input_len_max=40", "--set", "warmup_requests=1", "--no-progress"]  # fmt: skip


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
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert m[key]["p50"] is not None and m[key]["p50"] > 0, key
    assert m["cpu"]["server_cpu_pct"] >= 0 and "client_cpu_pct" in m["cpu"]
    assert data["gate_metrics"]["output_tok_s"] == m["output_tok_s"] > 0
