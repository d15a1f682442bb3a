"""P1-011 golden trace replay: the service records every scheduling decision it makes (adds,
retirements, the flat plan of every step, the tokens each commit got); replaying the trace
through the Python reference scheduler gives the same plan at every step."""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys

import httpx
import pytest

from minisgl.testing.server import start, wait_kv_clean

CARD = "P1-011"


def complete(base_url: str, body: dict) -> dict:
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.card(CARD, "golden-trace-replay")
def test_service_trace_replays_through_python_scheduler(tiny_llama, tmp_path):
    trace = tmp_path / "trace.jsonl"
    flags = ("--page-size", "4", "--max-prefill-length", "24", "--num-pages", "512")
    env = {"MINISGL_SERVICE_TRACE": str(trace)}
    with start("svc", tiny_llama, *flags, log_dir=tmp_path, backend="rust_service", env=env) as s:
        svc = s.get()
        shared = list(range(7, 47))
        bodies = [
            {"prompt": [*shared, 50 + i], "max_tokens": 6 + i, "temperature": 0} for i in range(6)
        ] + [
            {"prompt": "the cat sat", "max_tokens": 9, "stop": ["a"], "temperature": 0},
            {"prompt": list(range(3, 90)), "max_tokens": 3, "ignore_eos": True},
        ]
        with cf.ThreadPoolExecutor(8) as pool:  # concurrent: batching, chunking, prefix hits
            list(pool.map(lambda b: complete(svc.base_url, b), bodies))
        wait_kv_clean(svc)
    lines = trace.read_text().splitlines()
    kinds = {json.loads(line)["ev"] for line in lines}
    assert {"add", "schedule", "commit"} <= kinds, kinds
    r = subprocess.run(
        [sys.executable, "-m", "minisgl.scheduler.replay", str(trace)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["mismatches"] == 0 and report["steps"] >= 8, report
