"""P1-011 benchmark on the simulated device: python vs rust_service, one server each, a burst of
streams through the online A/B harness (`harness online --ab ... --sim-device`). The metrics
feed the card's relative gates (`worklog/gates/P1-011.yaml`); this test asserts only that both
arms did the same, complete work. The committed full-size runs are in `worklog/baselines/`."""

from __future__ import annotations

import json

import pytest

from minisgl.benchmark import harness

ARMS = ("python", "rust_service")
REQUESTS, OUTPUT_LEN = 64, 32
SMALL = ["--set", f"num_requests={REQUESTS}", "--set", f"output_len={OUTPUT_LEN}",
         "--set", "warmup_requests=2", "--no-progress"]  # fmt: skip


@pytest.mark.bench
@pytest.mark.card(
    "P1-011",
    "throughput-not-below-the-python-backend-on-the-simulated-device",
    "p99-ttft-under-a-burst-not-above-the-python-backend-s-on-the-simulated-device",
)
def test_sim_device_ab_python_vs_rust_service(tiny_llama, tmp_path, metric):
    out = tmp_path / "ab.json"
    rc = harness.main(
        ["online", "--ab", ",".join(ARMS), "--model-path", str(tiny_llama), "--sim-device",
         "--profile", "burst-256", "--repeats", "1", "--out", str(out), *SMALL]
    )  # fmt: skip
    assert out.exists(), f"the A/B run wrote no JSON (exit {rc})"
    data = json.loads(out.read_text())
    for arm in ARMS:
        m = data["results"][arm]["metrics"]
        assert (m["errors"], m["completed"]) == (0, REQUESTS), (arm, data["results"][arm])
        assert m["output_tokens"] == REQUESTS * OUTPUT_LEN, arm
        assert m["cpu"]["cp_cpu_s"] > 0, arm
        assert len(data["results"][arm]["client_saturated"]) == 1, arm  # flagged, not refused
        assert m["cpu"]["client_cpu_core_frac"] > 0, arm
        assert REQUESTS <= m["chunks"] <= m["output_tokens"], arm  # >= 1 token per SSE chunk
    assert rc == 0
    assert data["simulated_device"] is True and data["kind"] == "online-ab"
    assert data["outputs_identical"], {a: data["results"][a]["output_digests"] for a in ARMS}
    for arm in ARMS:
        m = data["results"][arm]["metrics"]
        metric(f"sim_output_tok_s_{arm}", m["output_tok_s"], unit="tok/s")
        metric(f"sim_ttft_p99_ms_{arm}", m["ttft_ms"]["p99"], unit="ms", higher_is_better=False)
        metric(
            f"sim_cp_cpu_s_per_token_{arm}",
            m["cpu"]["cp_cpu_s_per_token"],
            unit="s/token",
            higher_is_better=False,
        )
