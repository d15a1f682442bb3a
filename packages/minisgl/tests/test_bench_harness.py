"""Benchmark harness: deterministic profiles, JSON schema, overrides, gates (pass / fail)."""

from __future__ import annotations

import json

import pytest

from minisgl.benchmark import harness
from minisgl.benchmark.common import SCHEMA_VERSION, percentiles
from minisgl.benchmark.profiles import (
    PROFILES,
    build_workload,
    get_profile,
    parse_sets,
    warmup_workload,
)

SMALL = [
    "--set",
    "num_requests=3",
    "--set",
    "output_len=3",
    "--set",
    "input_len_min=4",
    "--set",
    "input_len_max=12",
    "--set",
    "warmup_requests=1",
]


@pytest.mark.card(
    "P0-001", "workload-profiles-are-deterministic-from-the-seed-and-have-their-documented-shapes"
)
@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profiles_are_deterministic_from_seed(name):
    p = get_profile(name, {"num_requests": "24"})
    a, b = build_workload(p, 384), build_workload(p, 384)
    assert [(w.prompt_ids, w.max_tokens, w.arrival_s) for w in a] == [
        (w.prompt_ids, w.max_tokens, w.arrival_s) for w in b
    ]
    other = build_workload(get_profile(name, {"num_requests": "24", "seed": "7"}), 384)
    assert [w.prompt_ids for w in other] != [w.prompt_ids for w in a]
    for w in a:
        n = len(w.prompt_ids) - p.prefix_len * (w.prefix_id >= 0)
        assert p.input_len_min <= n <= p.input_len_max
        assert all(0 <= t < 384 for t in w.prompt_ids)
        if p.output_len_min:  # a length range: every length inside it
            assert p.output_len_min <= w.max_tokens <= p.output_len
        else:
            assert w.max_tokens == p.output_len
    if p.output_len_min:
        assert len({w.max_tokens for w in a}) > 1
    assert len(warmup_workload(p, 384)) >= 1


@pytest.mark.card(
    "P0-001", "workload-profiles-are-deterministic-from-the-seed-and-have-their-documented-shapes"
)
def test_profile_shapes():
    assert get_profile("seed-offline").num_requests == 16
    assert get_profile("many-short").num_requests == 512
    shared = build_workload(get_profile("shared-prefix", {"num_requests": "40"}), 5000)
    groups = {w.prefix_id for w in shared}
    assert len(groups) > 1 and -1 not in groups
    first = {w.prefix_id: w.prompt_ids[:512] for w in shared}
    assert all(w.prompt_ids[:512] == first[w.prefix_id] for w in shared)
    burst = build_workload(get_profile("burst", {"num_requests": "200"}), 5000)
    times = [w.arrival_s for w in burst]
    assert times == sorted(times) and times.count(0.0) >= 32  # the first burst lands at t=0
    assert len(set(times)) > 10  # the rest are Poisson


@pytest.mark.card(
    "P0-001", "profile-overrides-are-typed-and-unknown-parameters-or-backends-are-usage-errors"
)
def test_overrides_coerce_and_reject_unknown():
    p = get_profile(
        "many-short", parse_sets(["num_requests=8", "ignore_eos=false", "request_rate=2.5"])
    )
    assert (p.num_requests, p.ignore_eos, p.request_rate) == (8, False, 2.5)
    with pytest.raises(ValueError, match="unknown profile parameter 'bogus'"):
        get_profile("many-short", {"bogus": "1"})
    with pytest.raises(ValueError, match="expected int"):
        get_profile("many-short", {"num_requests": "x"})
    with pytest.raises(ValueError, match="key=value"):
        parse_sets(["oops"])


@pytest.mark.card("P0-001", "latencies-reported-as-p50-p95-p99-percentiles")
def test_percentiles():
    p = percentiles([1, 2, 3, 4], 1000)
    assert p["p50"] == 2500 and p["max"] == 4000
    assert percentiles([])["p99"] is None


@pytest.fixture(scope="module")
def offline_run(tiny_model_dir, tmp_path_factory):
    """One small offline run with the HF baseline beside it; reused by the gate tests."""
    out = tmp_path_factory.mktemp("bench") / "run.json"
    rc = harness.main(
        [
            "offline",
            "--model-path",
            str(tiny_model_dir("llama")),
            "--out",
            str(out),
            "--engine",
            "hf",
            "--no-progress",
            "--repeats",
            "2",
            *SMALL,
            "--set",
            "llm.num_pages=512",
        ]
    )
    assert rc == 0
    return out, json.loads(out.read_text())


@pytest.mark.card(
    "P0-001",
    "results-json-records-schema-version-machine-git-commit-backend-env-model-and-profile",
    "hf-transformers-baseline-measured-in-the-same-run-with-the-speedup-in-the-gate-metrics",
    "latencies-reported-as-p50-p95-p99-percentiles",
    "scheduler-step-cpu-time-schedule-commit-reported-as-sched-step-cpu-ms-p50-p95-p99",
    "cpu-utilization-of-the-server-and-client-processes-recorded",
    "baseline-report-with-output-tok-s-ttft-p50-p95-p99-and-scheduler-step-latency-p50-p95-p99",
)
def test_offline_json_schema(offline_run):
    _, data = offline_run
    assert data["schema_version"] == SCHEMA_VERSION and data["kind"] == "offline"
    assert data["git"]["commit"] and data["machine"]["cpu"] and data["machine"]["hardware"]
    assert data["backend_env"]["MINISGL_CPU_BACKEND"]
    assert data["model"]["architecture"] == "LlamaForCausalLM"
    assert data["profile"]["num_requests"] == 3 and data["profile"]["output_len"] == 3
    assert data["llm_kwargs"] == {"num_pages": 512}
    m = data["results"]["minisgl"]["metrics"]
    assert len(data["results"]["minisgl"]["repeats"]) == 2
    assert m["output_tokens"] == 9 and m["completed"] == 3
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "sched_step_cpu_ms"):
        assert set(m[key]) >= {"p50", "p95", "p99"}, key
    assert m["output_tok_s"] > 0 and 0 < m["peak_kv_usage"] <= 1
    assert 0 <= m["prefix_hit_rate"] <= 1 and "client_cpu_pct" in m["cpu"]
    assert data["results"]["hf"]["metrics"]["output_tokens"] == 9
    g = data["gate_metrics"]
    assert g["output_tok_s"] == m["output_tok_s"]
    assert g["speedup_vs_hf.output_tok_s"] == pytest.approx(
        m["output_tok_s"] / data["results"]["hf"]["metrics"]["output_tok_s"]
    )
    assert "ttft_ms.p99" in g and "hf.output_tok_s" in g


def _gate(tmp_path, text):
    path = tmp_path / "g.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.card(
    "P0-001",
    "gates-files-evaluated-by-cardgate-s-evaluator-a-miss-fails-naming-the-threshold",
    "scheduler-step-cpu-time-schedule-commit-reported-as-sched-step-cpu-ms-p50-p95-p99",
)
def test_gates_pass_and_fail(offline_run, tmp_path, capsys, monkeypatch):
    out, data = offline_run
    from minisgl.benchmark import gating

    metrics = data["gate_metrics"]
    ok_gate = _gate(
        tmp_path,
        "version: 1\ngates:\n  - metric: output_tok_s\n    min: 0.001\n"
        "  - metric: sched_step_cpu_ms.p99\n    max: 100000\n",
    )
    ok, _, lines = gating.check_gates([ok_gate], metrics, "cpu")
    assert ok and all(line.startswith("PASS") for line in lines)
    bad_gate = _gate(tmp_path, "version: 1\ngates:\n  - metric: output_tok_s\n    min: 1.0e12\n")
    ok, _, lines = gating.check_gates([bad_gate], metrics, "cpu")
    assert not ok and "output_tok_s" in lines[0] and "missed by" in lines[0]
    missing = _gate(tmp_path, "version: 1\ngates:\n  - metric: nope\n    min: 1\n")
    assert not gating.check_gates([missing], metrics, "cpu")[0]
    assert gating.check_gates([missing], metrics, "cpu", allow_missing=True)[0]
    rel = _gate(
        tmp_path, "version: 1\ngates:\n  - metric: output_tok_s\n    relative:\n      factor: 2.0\n"
    )  # twice the recorded baseline: fails
    base = gating.load_baseline_metrics(out)
    ok, _, lines = gating.check_gates([rel], metrics, "cpu", base)
    assert not ok and "2 x output_tok_s" in lines[0]


@pytest.mark.card(
    "P0-001", "gates-files-evaluated-by-cardgate-s-evaluator-a-miss-fails-naming-the-threshold"
)
def test_cli_gate_failure_exits_nonzero(tiny_model_dir, tmp_path, capsys):
    gate = _gate(
        tmp_path,
        "version: 1\ngates:\n  - metric: output_tok_s\n    min: 1.0e12\n"
        "  - metric: request_s\n    min: 0.0\n",
    )
    out = tmp_path / "r.json"
    rc = harness.main(
        [
            "offline",
            "--model-path",
            str(tiny_model_dir("llama")),
            "--out",
            str(out),
            "--gate",
            gate,
            "--no-progress",
            *SMALL,
        ]
    )
    assert rc == 1
    err = capsys.readouterr().err
    assert "GATE FAILED" in err and "output_tok_s" in err and "missed by" in err
    assert "request_s" not in err  # the passing rule is not reported as a failure
    data = json.loads(out.read_text())
    assert data["gates"]["passed"] is False
    assert {r["status"] for r in data["gates"]["results"]} == {"pass", "fail"}


@pytest.mark.card(
    "P0-001", "profile-overrides-are-typed-and-unknown-parameters-or-backends-are-usage-errors"
)
def test_cli_rejects_bad_usage(tiny_model_dir, capsys):
    assert harness.main(["offline", "--set", "bogus=1", "--no-progress"]) == 2
    assert "unknown profile parameter" in capsys.readouterr().err
    assert harness.main(["offline", "--ab", "python,nonexistent", "--no-progress"]) == 2
    assert "nonexistent" in capsys.readouterr().err


def test_nano_vllm_profile_has_uniform_input_and_output_lengths():
    p = get_profile("nano-vllm")
    items = build_workload(p, 151936)
    assert len(items) == 256 and all(w.arrival_s == 0.0 for w in items)
    ins, outs = [len(w.prompt_ids) for w in items], [w.max_tokens for w in items]
    assert min(ins) >= 100 and max(ins) <= 1024 and min(outs) >= 100 and max(outs) <= 1024
    assert min(ins) < 200 and max(ins) > 900 and min(outs) < 200 and max(outs) > 900
    assert [w.max_tokens for w in build_workload(p, 151936)] == outs  # seeded
    with pytest.raises(ValueError, match="output_len_min"):
        get_profile("nano-vllm", {"output_len_min": "2000"})


def test_longest_steps_name_their_index_and_duration():
    from minisgl.benchmark.offline import longest_steps

    assert longest_steps([0.01, 0.5, 0.02, 0.2, 0.01], top=2) == [
        {"step": 1, "ms": 500.0},
        {"step": 3, "ms": 200.0},
    ]
    assert longest_steps([], top=3) == []


def test_an_offline_run_reports_each_steps_wall_time(tiny_model_dir, monkeypatch):
    """A stalled step (a kernel compiled mid-run, on a GPU) shows as the run's longest step,
    with its index, beside the distribution of step wall times."""
    import time

    from minisgl import LLM
    from minisgl.benchmark.offline import run_minisgl

    p = get_profile("many-short", {"num_requests": "6", "output_len": "4"})
    llm = LLM(tiny_model_dir("llama"), sim_device="0.2,0.001", num_pages=512)
    step, calls = llm.step, []

    def stalled_step():
        calls.append(1)
        if len(calls) == 3:
            time.sleep(0.25)
        return step()

    monkeypatch.setattr(llm, "step", stalled_step)
    m = run_minisgl(llm, build_workload(p, 384))["metrics"]
    assert m["step_wall_ms"]["max"] >= 250 and m["step_wall_ms"]["p50"] < 100
    assert m["longest_steps"][0]["step"] == 2 and m["longest_steps"][0]["ms"] >= 250
    assert len(m["longest_steps"]) == 5 and len(calls) >= 5
