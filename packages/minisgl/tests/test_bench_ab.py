"""The one A/B driver (`benchmark/ab.py`) with fake arms that report fixed numbers: the ABBA
order, medians of the repeats, ratios of the medians and of paired repeats, the gate names,
and the JSON that `tp_ab` and `overlap_ab` (offline `LLM` pairs) keep."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from minisgl.benchmark import ab, offline, overlap_ab, tp_ab


def test_arms_run_interleaved_abba_and_keep_repeat_order():
    calls: list[tuple[str, int]] = []

    def run(arm: str, rep: int) -> str:
        calls.append((arm, rep))
        return f"{arm}{rep}"

    outs = ab.interleave(["a", "b", "c"], 3, run)
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("a", 1),
                     ("a", 2), ("b", 2), ("c", 2)]  # fmt: skip
    assert outs == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"], "c": ["c0", "c1", "c2"]}


RUNS = {
    "base": [{"tok_s": 100.0, "lat": {"p50": 10.0}, "tag": "x"},
             {"tok_s": 120.0, "lat": {"p50": 30.0}, "tag": "y"},
             {"tok_s": 90.0, "lat": {"p50": 20.0}, "tag": "z"}],
    "fast": [{"tok_s": 300.0, "lat": {"p50": 5.0}, "tag": "x"},
             {"tok_s": 240.0, "lat": {"p50": 15.0}, "tag": "y"},
             {"tok_s": 270.0, "lat": {"p50": 10.0}, "tag": "z"}],
}  # fmt: skip


def test_medians_of_repeats_and_ratios_against_the_first_arm():
    cmp = ab.compare(RUNS, ("tok_s", "lat.p50", "missing"), ("tok_s",))
    assert cmp.medians["base"] == {"tok_s": 100.0, "lat": {"p50": 20.0}, "tag": "x"}
    assert cmp.medians["fast"] == {"tok_s": 270.0, "lat": {"p50": 10.0}, "tag": "x"}
    assert cmp.ratio == {"fast": {"tok_s": pytest.approx(2.7), "lat.p50": pytest.approx(0.5)}}
    # paired within each repeat: 3.0, 2.0, 3.0 -> median 3.0 (the medians' ratio is 2.7)
    assert cmp.paired["fast"]["tok_s"] == pytest.approx(3.0)
    assert cmp.paired["fast"]["tok_s_per_repeat"] == pytest.approx([3.0, 2.0, 3.0])
    assert cmp.results()["fast"] == {"metrics": cmp.medians["fast"], "repeats": RUNS["fast"]}
    assert set(cmp.tables()) == {
        "fast / base (ratio of medians)",
        "fast / base (median of paired repeats)",
    }
    assert "tok_s_per_repeat" not in cmp.tables()["fast / base (median of paired repeats)"]


def test_gate_names_with_and_without_the_arm():
    cmp = ab.compare(RUNS, ("tok_s",), ("tok_s",))
    g = cmp.gate_metrics()
    assert g["ab.base.tok_s"] == 100.0 and g["ab.fast.lat.p50"] == 10.0
    assert g["ab_ratio.fast.tok_s"] == pytest.approx(2.7)
    assert g["ab_ratio_paired.fast.tok_s"] == pytest.approx(3.0)
    assert "ab.base.tag" not in g  # numbers only
    bare = cmp.gate_metrics(arm_names=False)
    assert bare["ab_ratio.tok_s"] == pytest.approx(2.7) and "ab_ratio.fast.tok_s" not in bare


def test_a_median_of_chosen_keys():
    cmp = ab.compare(RUNS, ("tok_s",), median=ab.key_medians(("tok_s",)))
    assert cmp.medians == {"base": {"tok_s": 100.0}, "fast": {"tok_s": 270.0}}


class FakeLLM(SimpleNamespace):
    closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_llms(monkeypatch) -> dict[str, Any]:
    """`make_llm` builds a FakeLLM (its kwargs kept); each timed run of an arm reports
    `speed x (1, 1.1, 1.2, ...)` tok/s, its warm-up runs are not counted."""
    made: dict[str, Any] = {"llms": [], "calls": []}

    def make_llm(model_path, profile, kw):
        comm = SimpleNamespace(calls=0, seconds=0.0)
        comm.reset_stats = lambda: made["calls"].append("reset")
        llm = FakeLLM(
            kw=kw,
            engine=SimpleNamespace(model_config=SimpleNamespace(vocab_size=512),
                                   leader=SimpleNamespace(comm=comm), dtype="torch.float32",
                                   device="cpu"),
            runtime=SimpleNamespace(depth=1 if kw.get("overlap") else 0,
                                    loop=SimpleNamespace(stream=SimpleNamespace(name="inline"))),
            config=SimpleNamespace(model_path="/m/tiny"),
        )  # fmt: skip
        made["llms"].append(llm)
        return llm

    def run_minisgl(llm, items, honor_arrivals=True):
        assert honor_arrivals is False
        idx = made["llms"].index(llm)
        if all(it.max_tokens <= 4 for it in items):
            made["calls"].append(f"warm{idx}")
            return {"metrics": {}, "token_ids": []}
        made["calls"].append(f"run{idx}")
        n = sum(1 for c in made["calls"] if c == f"run{idx}")
        comm = llm.engine.leader.comm
        comm.calls, comm.seconds = comm.calls + 10, comm.seconds + 0.5
        tok_s = 100.0 * (idx + 1) * (1 + 0.1 * (n - 1))
        metrics = {"output_tok_s": tok_s, "e2e_ms": {"p50": 1e3 / tok_s},
                   "tpot_ms": {"p50": 1.0}, "steps": 5}  # fmt: skip
        return {"metrics": metrics, "token_ids": [[1, 2, 3], [4, 5, 6 + idx]]}

    for mod in (tp_ab, overlap_ab):
        monkeypatch.setattr(mod, "make_llm", make_llm)
    monkeypatch.setattr(offline, "run_minisgl", run_minisgl)
    return made


def test_tp_ab_keeps_its_json(fake_llms, tmp_path):
    out = tmp_path / "tp.json"
    argv = ["--model-path", "/m/tiny", "--tp", "2", "--threads", "4", "--repeats", "3",
            "--requests", "2", "--out", str(out)]  # fmt: skip
    assert tp_ab.main(argv) == 0
    assert fake_llms["calls"][:2] == ["warm0", "warm1"] and "reset" in fake_llms["calls"][2:4]
    timed = [c for c in fake_llms["calls"] if c.startswith("run")]
    assert timed == ["run0", "run1", "run1", "run0", "run0", "run1"]  # ABBA
    assert all(llm.closed for llm in fake_llms["llms"])
    assert [llm.kw["threads"] for llm in fake_llms["llms"]] == [4, 2]
    doc = json.loads(out.read_text())
    assert doc["kind"] == "tp-ab" and doc["argv"][:-1] == argv[:-1] and doc["git"]["commit"]
    assert set(doc) >= {"loadavg_before_after", "wall_s", "profile", "model", "dtype", "threads",
                        "repeats", "results", "tp_over_tp1", "tp_over_tp1_paired",
                        "collectives_rank0", "greedy_agreement", "machine"}  # fmt: skip
    assert doc["threads"] == {"tp1": 4, "tp2": 2} and doc["dtype"] == "float32"
    assert doc["model"] == "tiny" and doc["repeats"] == 3
    assert doc["results"]["tp1"]["metrics"]["output_tok_s"] == pytest.approx(110.0)
    assert len(doc["results"]["tp2"]["repeats"]) == 3
    assert doc["tp_over_tp1"]["output_tok_s"] == pytest.approx(2.0)
    assert doc["tp_over_tp1_paired"]["output_tok_s_per_repeat"] == pytest.approx([2.0] * 3)
    c = doc["collectives_rank0"]
    assert c["calls_per_step"] == pytest.approx(30 / 15) and c["ms_per_step"] == pytest.approx(100)
    assert doc["greedy_agreement"] == {"identical_requests": 1, "requests": 2,
                                       "first_divergence": [2]}  # fmt: skip


def test_overlap_ab_keeps_its_json(fake_llms, tmp_path):
    out = tmp_path / "ov.json"
    argv = ["--sim-device", "2,0.02", "--repeats", "2", "--requests", "2", "--out", str(out)]
    assert overlap_ab.main(argv) == 0
    assert [llm.kw["overlap"] for llm in fake_llms["llms"]] == [False, True]
    assert all(llm.kw["sim_device"] == "2,0.02" for llm in fake_llms["llms"])
    assert all(llm.closed for llm in fake_llms["llms"])
    doc = json.loads(out.read_text())
    assert doc["kind"] == "overlap-ab" and doc["argv"][:-1] == argv[:-1]
    assert set(doc) >= {"loadavg_before_after", "wall_s", "profile", "model", "simulated_device",
                        "device_stream", "device", "repeats", "results", "overlap_over_serial",
                        "overlap_over_serial_paired", "machine", "git"}  # fmt: skip
    assert (doc["model"], doc["simulated_device"]) == ("tiny", "2,0.02")
    assert (doc["device_stream"], doc["device"]) == ("inline", "cpu")
    assert doc["results"]["serial"]["metrics"]["output_tok_s"] == pytest.approx(105.0)
    assert doc["overlap_over_serial"]["output_tok_s"] == pytest.approx(2.0)
    assert doc["overlap_over_serial_paired"]["output_tok_s"] == pytest.approx(2.0)


def test_structured_ab_keeps_its_json(monkeypatch, tmp_path):
    from minisgl.benchmark import structured_ab

    calls: list[str] = []
    warmed: list[int] = []
    llm = SimpleNamespace(
        engine=SimpleNamespace(model_config=SimpleNamespace(vocab_size=512)),
        generate=lambda prompts, params: warmed.append(len(prompts)),
    )

    def run_arm(llm_, prompts, params):
        arm = ("free" if params[0].response_format is None
               else "mixed" if params[1].response_format is None else "constrained")  # fmt: skip
        calls.append(arm)
        wall = {"free": 1.0, "constrained": 1.3, "mixed": 1.02}[arm] * (1 + 0.1 * calls.count(arm))
        return {"wall_s": wall, "output_tokens": 96, "output_tok_s": 96 / wall,
                "errors": 1 if arm == "mixed" else 0, "first_error": None}  # fmt: skip

    monkeypatch.setattr(structured_ab, "make_llm", lambda *a: llm)
    monkeypatch.setattr(structured_ab, "run_arm", run_arm)
    out = tmp_path / "s.json"
    argv = ["--requests", "6", "--repeats", "3", "--out", str(out)]
    assert structured_ab.main(argv) == 1  # the mixed arm reported errors
    assert len(warmed) == 3  # one warm-up batch per arm
    assert calls == ["free", "constrained", "mixed", "mixed", "constrained", "free",
                     "free", "constrained", "mixed"]  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["tool"] == "structured_ab" and doc["argv"][:-1] == argv[:-1]
    assert {"schema_version", "git", "machine", "env", "response_format"} <= set(doc)
    assert (doc["profile"], doc["num_requests"]) == ("many-short", 6)
    assert doc["median"]["free"] == {
        "wall_s": pytest.approx(1.2),
        "output_tok_s": pytest.approx(96 / 1.2),
        "output_tokens": 96,
        "errors": 0,
    }
    assert doc["median"]["mixed"]["errors"] == 3  # summed over the repeats
    assert doc["ratios"] == {"constrained_vs_free_wall": pytest.approx(1.3),
                             "mixed_vs_free_wall": pytest.approx(1.02)}  # fmt: skip
    assert [r["wall_s"] for r in doc["repeats"]["free"]] == pytest.approx([1.1, 1.2, 1.3])


def test_offline_ab_keeps_its_json(monkeypatch, tmp_path):
    """`harness offline --ab`: one subprocess per arm and repeat (stubbed: each writes fixed
    numbers), the medians, ratios and the gate names of two arms (no arm in the ratios')."""
    import subprocess

    from minisgl.benchmark import harness
    from minisgl.benchmark.backends import ENV

    calls: list[str] = []
    real = subprocess.run

    def fake_run(cmd, env=None, check=False, **kw):
        if "minisgl.benchmark.harness" not in cmd:  # git, nvidia-smi
            return real(cmd, env=env, check=check, **kw)
        arm = env[ENV]
        calls.append(arm)
        tok_s = {"python": 100.0, "rust_hotpath": 150.0}[arm] * (1 + 0.1 * calls.count(arm))
        metrics = {"output_tok_s": tok_s, "output_tok_per_cpu_s": tok_s / 2, "e2e_ms": {"p99": 9.0}}
        data = {"results": {"minisgl": {"metrics": metrics, "samples": {"ttft_ms": [1.0]}}},
                "backend_env": {ENV: arm}}  # fmt: skip
        (Path(cmd[cmd.index("--out") + 1])).write_text(json.dumps(data))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(harness.subprocess, "run", fake_run)
    monkeypatch.setattr(harness, "check_cpu_backend", lambda name: None)
    out = tmp_path / "ab.json"
    argv = ["offline", "--ab", "python,rust_hotpath", "--repeats", "3", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert harness.main(argv) == 0
    assert calls == ["python", "rust_hotpath", "rust_hotpath", "python", "python", "rust_hotpath"]
    doc = json.loads(out.read_text())
    assert doc["kind"] == "offline-ab" and doc["arms"] == ["python", "rust_hotpath"]
    assert doc["arm_env"] == {"python": {ENV: "python"}, "rust_hotpath": {ENV: "rust_hotpath"}}
    py = doc["results"]["python"]
    assert py["metrics"]["output_tok_s"] == pytest.approx(120.0) and len(py["repeats"]) == 3
    assert py["samples"] == {"ttft_ms": [1.0]}
    assert doc["ab_ratio"]["rust_hotpath"]["output_tok_s"] == pytest.approx(1.5)
    paired = doc["ab_ratio_paired"]["rust_hotpath"]
    assert paired["output_tok_per_cpu_s_per_repeat"] == pytest.approx([1.5] * 3)
    g = doc["gate_metrics"]
    assert g["output_tok_s"] == pytest.approx(120.0)  # the base arm's, unprefixed
    assert g["ab.rust_hotpath.e2e_ms.p99"] == 9.0
    assert g["ab_ratio.output_tok_s"] == pytest.approx(1.5)
    assert g["ab_ratio_paired.output_tok_s"] == pytest.approx(1.5)


def test_offline_ab_stops_at_a_failed_arm(monkeypatch, tmp_path, capsys):
    import subprocess

    from minisgl.benchmark import harness

    real = subprocess.run

    def failing(cmd, env=None, check=False, **kw):
        if "minisgl.benchmark.harness" not in cmd:
            return real(cmd, env=env, check=check, **kw)
        if check:
            raise subprocess.CalledProcessError(3, cmd)
        return subprocess.CompletedProcess(cmd, 3)

    monkeypatch.setattr(harness.subprocess, "run", failing)
    monkeypatch.setattr(harness, "check_cpu_backend", lambda name: None)
    argv = ["offline", "--ab", "python,rust_hotpath", "--out", str(tmp_path / "ab.json"),
            "--no-progress"]  # fmt: skip
    assert harness.main(argv) == 2
    assert "exit status 3" in capsys.readouterr().err
    assert not (tmp_path / "ab.json").exists()
