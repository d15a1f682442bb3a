"""The online A/B harness without servers: roles and CPU counting, server sizing, the result's
shape (medians, ratios, paired repeats, ABBA order, labels) and usage errors."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from minisgl.benchmark import harness, online_ab
from minisgl.benchmark.online_ab import server_flags
from minisgl.benchmark.profiles import WorkItem, build_workload, get_profile
from minisgl.benchmark.roles import RoleCpuMeter, role_of


def test_roles_of_the_workers_health_names():
    assert [
        role_of(n) for n in ("scheduler", "tokenizer0", "tokenizer3", "service", "worker0")
    ] == [
        "scheduler",
        "tokenizer",
        "tokenizer",
        "service",
        "gpu_worker",
    ]
    assert role_of("resource_tracker") == "other"


def test_control_plane_cpu_leaves_out_the_gpu_workers():
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass"
    procs = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(2)]
    try:
        with RoleCpuMeter({"service": [procs[0].pid], "gpu_worker": [procs[1].pid]}) as meter:
            for p in procs:
                p.wait(30)
    finally:
        for p in procs:
            p.kill()
    r = meter.result
    # both exited before the window closed: a process gone at the end is left out entirely
    assert r["cpu_s"] == {} and r["server_cpu_s"] == r["cp_cpu_s"] == 0.0

    wait = burn + "\nprint('burnt', flush=True)\ninput()"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", wait], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        with RoleCpuMeter({"service": [procs[0].pid], "gpu_worker": [procs[1].pid]}) as meter:
            assert [p.stdout.readline() for p in procs] == ["burnt\n"] * 2  # both still run
        r = meter.result
        assert set(r["cpu_s"]) == {"service", "gpu_worker"}
        assert r["cpu_s"]["service"] > 0.1 and r["cpu_s"]["gpu_worker"] > 0.1
        assert r["server_cpu_s"] == pytest.approx(r["cpu_s"]["service"] + r["cpu_s"]["gpu_worker"])
        assert r["cp_cpu_s"] == pytest.approx(r["cpu_s"]["service"])
        assert r["client_cpu_s"] >= 0
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_server_flags_fit_the_profile():
    p = get_profile("burst-256")
    flags = server_flags(p, "0.5,0.002", ["--page-size=16"])
    val = {flags[i]: flags[i + 1] for i in range(0, len(flags) - 1, 2) if flags[i].startswith("--")}
    assert val["--max-running-requests"] == "256"
    assert int(val["--max-queued-requests"]) >= p.num_requests
    longest = int(val["--max-seq-len-override"])
    assert longest >= p.input_len_max + p.output_len
    assert int(val["--num-pages"]) >= 256 * longest
    assert val["--sim-device"] == "0.5,0.002" and flags[-1] == "--page-size=16"
    assert "--sim-device" not in server_flags(p, None, [])


def test_burst_256_profile_is_one_burst_of_256_streams():
    p = get_profile("burst-256")
    items = build_workload(p, 5000)
    assert len(items) == 256 and {w.arrival_s for w in items} == {0.0}
    assert p.concurrency == p.max_running_requests == 256


def fake_arm(calls: list[str]):
    """`run_arm` stand-in: rust_service twice python's throughput, half its CPU per token."""

    def run(args, arm, profile, log_dir, prog):
        calls.append(arm)
        rep = sum(1 for c in calls if c == arm)
        tok_s = {"python": 100.0, "rust_service": 200.0}[arm] * (1 + 0.1 * rep)
        cp = {"python": 0.002, "rust_service": 0.001}[arm]
        metrics = {
            "output_tokens": 1000,
            "output_tok_s": tok_s,
            "request_s": tok_s / 10,
            "completed": 10,
            "errors": 0,
            "ttft_ms": {"p50": 10.0, "p99": 40.0 if arm == "python" else 20.0},
            "tpot_ms": {"p50": 1.0, "p99": 2.0},
            "cpu": {
                "cp_cpu_s": cp * 1000,
                "server_cpu_s": 2.0,
                "wall_s": 2.0,
                "client_cpu_s": 1.8 if (arm, rep) == ("python", 2) else 0.2,  # 0.9, 0.1 core
            },
        }
        online_ab.per_token(metrics)
        items = [WorkItem(0, [1, 2], 3)]
        return {
            "metrics": metrics,
            "items": items,
            "token_times": [[0.01, 0.02, 0.03]],
            "error_samples": [],
            "texts": ["same"],
            "roles": {"launcher": 1},
            "info": {},
        }

    return run


def test_ab_result_shape(monkeypatch, tmp_path, tiny_model_dir):
    calls: list[str] = []
    monkeypatch.setattr(online_ab, "run_arm", fake_arm(calls))
    monkeypatch.setattr(online_ab, "check_server_backend", lambda name: None)
    out, png = tmp_path / "ab.json", tmp_path / "ab.png"
    rc = harness.main(
        ["online", "--ab", "python,rust_service", "--sim-device", "1,0.01", "--repeats", "3",
         "--profile", "burst-256", "--model-path", str(tiny_model_dir("llama")), "--out",
         str(out), "--plot", str(png), "--no-progress", "--note", "shared 2-core box"]
    )  # fmt: skip
    assert rc == 0
    assert calls == ["python", "rust_service", "rust_service", "python", "python", "rust_service"]
    data = json.loads(out.read_text())
    assert data["kind"] == "online-ab" and data["arms"] == ["python", "rust_service"]
    assert data["simulated_device"] is True
    assert (data["sim_device"]["base_ms"], data["sim_device"]["token_ms"]) == (1.0, 0.01)
    assert "SIMULATED" in data["sim_device"]["note"]
    assert data["notes"] == ["shared 2-core box"] and "gpu_worker" in data["cpu_counting"]
    assert data["outputs_identical"] is True
    py, rs = (data["results"][a]["metrics"] for a in ("python", "rust_service"))
    assert py["output_tok_s"] == pytest.approx(120.0)  # median of 110, 120, 130
    assert rs["cpu"]["cp_cpu_s_per_token"] == pytest.approx(0.001)
    assert len(data["results"]["python"]["repeats"]) == 3
    ratio = data["ab_ratio"]["rust_service"]
    assert ratio["output_tok_s"] == pytest.approx(2.0)
    assert ratio["ttft_ms.p99"] == pytest.approx(0.5)
    assert ratio["cpu.cp_cpu_s_per_token"] == pytest.approx(0.5)
    paired = data["ab_ratio_paired"]["rust_service"]
    assert paired["output_tok_s_per_repeat"] == pytest.approx([2.0, 2.0, 2.0])
    g = data["gate_metrics"]
    assert g["ab.rust_service.output_tok_s"] == pytest.approx(240.0)
    assert g["ab_ratio.rust_service.cpu.cp_cpu_s_per_token"] == pytest.approx(0.5)
    assert png.stat().st_size > 0
    # the client saturated (0.9 of a core > 0.7) in python's second repeat only: flagged
    assert data["results"]["python"]["client_saturated"] == [False, True, False]
    assert data["results"]["rust_service"]["client_saturated"] == [False] * 3
    assert data["results"]["python"]["client_cpu_core_frac"] == pytest.approx([0.1, 0.9, 0.1])
    assert py["cpu"]["client_saturated"] is True and rs["cpu"]["client_saturated"] is False
    assert data["client"]["saturated"] is True and data["client"]["refused"] is False
    assert data["client"]["saturated_runs"] == ["python#1"]
    assert g["ab.python.cpu.client_cpu_core_frac"] == pytest.approx(0.1)  # the median


def test_ab_refuses_a_saturated_client(monkeypatch, tmp_path, tiny_model_dir, capsys):
    monkeypatch.setattr(online_ab, "run_arm", fake_arm([]))
    monkeypatch.setattr(online_ab, "check_server_backend", lambda name: None)
    out = tmp_path / "ab.json"
    rc = harness.main(
        ["online", "--ab", "python,rust_service", "--repeats", "2", "--model-path",
         str(tiny_model_dir("llama")), "--out", str(out), "--no-progress",
         "--refuse-saturated-client"]
    )  # fmt: skip
    assert rc == 3
    assert "client saturated" in capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["client"]["refused"] is True and data["client"]["saturated_runs"] == ["python#1"]


def test_ab_flags_different_outputs(monkeypatch, tmp_path, tiny_model_dir):
    run = fake_arm([])

    def differ(args, arm, *rest):
        out = run(args, arm, *rest)
        out["texts"] = [arm]
        return out

    monkeypatch.setattr(online_ab, "run_arm", differ)
    monkeypatch.setattr(online_ab, "check_server_backend", lambda name: None)
    out = tmp_path / "ab.json"
    harness.main(["online", "--ab", "python,rust_service", "--model-path",
                  str(tiny_model_dir("llama")), "--out", str(out), "--no-progress"])  # fmt: skip
    data = json.loads(out.read_text())
    assert data["outputs_identical"] is False and data["simulated_device"] is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ab", "python"], "at least two distinct"),
        (["--ab", "python,python"], "at least two distinct"),
        (["--ab", "python,fortran"], "fortran"),
        (["--ab", "python,rust_service", "--sim-device", "fast"], "BASE_MS"),
        (["--ab", "python,rust_hotpath"], "runs in process only"),
        (["--sim-device"], "applies with --ab"),
        (["--ab", "python,rust_service", "--set", "llm.page_size=16"], "--server-arg"),
    ],
)
def test_usage_errors(argv, message, capsys):
    assert harness.main(["online", *argv, "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_median_interval_from_order_statistics():
    """A distribution-free 95% interval for the median: order statistics whose binomial
    coverage is >= 95% (6 values: the extremes, 1 - 2/64; fewer cannot reach 95%)."""
    from minisgl.benchmark.pooled import median_interval

    assert median_interval([3.0, 1.0, 2.0, 6.0, 5.0]) is None  # 5 values: at most 93.75%
    assert median_interval([4.0, 1.0, 6.0, 2.0, 5.0, 3.0]) == (1.0, 6.0)
    lo, hi = median_interval([float(x) for x in range(100)])
    assert (lo, hi) == (39.0, 60.0)  # ranks 40 and 61 of 100 (binomial coverage 96.5%)
    assert median_interval([2.0] * 9, confidence=0.5) == (2.0, 2.0)


def test_ab_pools_repeats_and_reads_the_ttft_overhead(monkeypatch, tmp_path, tiny_model_dir):
    """Issue 39's seed-online goal is a TTFT overhead over the simulated prefill: the record
    states the prefill it subtracts (every prompt of the one concurrent wave in one step:
    base + token_ms x prompt tokens), the pooled TTFT of every request of every repeat, and an
    interval for the median of the repeats' p50s (the repeats are the independent units)."""
    calls: list[str] = []
    base = fake_arm(calls)

    def run(args, arm, profile, log_dir, prog):
        out = base(args, arm, profile, log_dir, prog)
        rep = sum(1 for c in calls if c == arm)
        ttfts = [0.010 + 0.001 * rep + 0.0001 * k for k in range(8)]
        out["items"] = [WorkItem(0, [1, 2], 3) for _ in ttfts]
        out["token_times"] = [[t, t + 0.001] for t in ttfts]
        out["metrics"]["ttft_ms"] = {"p50": 1e3 * statistics.median(ttfts), "p99": 20.0}
        out["metrics"]["input_tokens"] = 1500
        return out

    monkeypatch.setattr(online_ab, "run_arm", run)
    monkeypatch.setattr(online_ab, "check_server_backend", lambda name: None)
    out = tmp_path / "ab.json"
    rc = harness.main(
        ["online", "--ab", "python,rust_service", "--sim-device", "0.5,0.002", "--repeats", "6",
         "--profile", "seed-online", "--model-path", str(tiny_model_dir("llama")), "--out",
         str(out), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["sim_device"]["prefill_ms"] == pytest.approx(0.5 + 0.002 * 1500)
    for arm in ("python", "rust_service"):
        pooled = data["results"][arm]["pooled"]
        assert pooled["ttft_ms"]["n"] == 48
        every = sorted(
            1e3 * (0.010 + 0.001 * r + 0.0001 * k) for r in range(1, 7) for k in range(8)
        )
        assert pooled["ttft_ms"]["p50"] == pytest.approx(statistics.median(every))
        p50s = [1e3 * (0.010 + 0.001 * r + 0.00035) for r in range(1, 7)]
        assert pooled["ttft_ms"]["repeat_p50_ci95"] == pytest.approx([min(p50s), max(p50s)])
        median_p50 = statistics.median(p50s)
        assert pooled["ttft_overhead_ms_p50"] == pytest.approx(median_p50 - 3.5)
