from __future__ import annotations

from pathlib import Path

import pytest

from cardgate.thresholds import GateFormatError, evaluate, load_gates, parse_gates, summarize

P = pytest.mark.card


def _gates(*rules: dict) -> object:
    return parse_gates({"version": 1, "gates": list(rules)}, "t.yaml")


@P("P0-000", "absolute-and-relative-thresholds-with-noise-floor")
def test_absolute_min_max() -> None:
    gates = _gates({"metric": "tok_s", "min": 100, "max": 200})
    low, high = evaluate(gates, {"tok_s": 90.0}, "cpu")
    assert (low.check, low.status, low.threshold, low.margin) == ("min", "fail", 100.0, -10.0)
    assert high.status == "pass" and high.margin == 110.0
    assert "missed by 10" in low.message
    assert [r.status for r in evaluate(gates, {"tok_s": 250.0}, "cpu")] == ["pass", "fail"]
    assert summarize(evaluate(gates, {"tok_s": 150.0}, "cpu")) == "pass"


@P("P0-000", "absolute-and-relative-thresholds-with-noise-floor")
def test_relative_to_a_baseline_metric_of_the_same_run() -> None:
    gates = _gates({"metric": "rust", "relative": {"baseline": "py", "factor": 10}})
    (ok,) = evaluate(gates, {"rust": 1000.0, "py": 100.0}, "cpu")
    (bad,) = evaluate(gates, {"rust": 999.0, "py": 100.0}, "cpu")
    assert ok.status == "pass" and ok.threshold == 1000.0
    assert bad.status == "fail" and bad.margin == pytest.approx(-1.0)
    (missing,) = evaluate(gates, {"rust": 1000.0}, "cpu")
    assert missing.status == "missing" and "baseline 'py'" in missing.message
    # the baseline may come from another run (e.g. a recorded baseline)
    (other,) = evaluate(gates, {"rust": 1000.0}, "cpu", baseline={"py": 50.0})
    assert other.status == "pass" and other.threshold == 500.0
    same = _gates({"metric": "tok_s", "relative": {"factor": 1.1}})
    assert evaluate(same, {"tok_s": 105.0}, "cpu", baseline={"tok_s": 100.0})[0].status == "fail"


@P("P0-000", "absolute-and-relative-thresholds-with-noise-floor")
def test_noise_floor_and_lower_is_better() -> None:
    rule = {"metric": "new", "relative": {"baseline": "old", "factor": 1.0, "noise_floor": 0.05}}
    assert evaluate(_gates(rule), {"new": 96.0, "old": 100.0}, "cpu")[0].status == "pass"
    assert evaluate(_gates(rule), {"new": 94.0, "old": 100.0}, "cpu")[0].status == "fail"
    lat = {"metric": "p99", "relative": {"baseline": "p99_ref", "factor": 1.0, "noise_floor": 0.1}}
    lat["relative"]["direction"] = "lower"
    assert evaluate(_gates(lat), {"p99": 10.9, "p99_ref": 10.0}, "cpu")[0].status == "pass"
    assert evaluate(_gates(lat), {"p99": 11.1, "p99_ref": 10.0}, "cpu")[0].status == "fail"


@P("P0-000", "thresholds-keyed-by-hardware")
def test_hardware_keyed_rules() -> None:
    gates = _gates(
        {"metric": "tok_s", "hardware": "cpu", "min": 10},
        {"metric": "tok_s", "hardware": "*H100*", "min": 1000},
        {"metric": "tok_s", "hardware": "NVIDIA GeForce RTX 3060", "min": 500},
        {"metric": "tok_s", "min": 1},
    )
    on_cpu = evaluate(gates, {"tok_s": 20.0}, "cpu")
    assert [r.status for r in on_cpu] == ["pass", "n/a", "n/a", "pass"]
    on_h100 = evaluate(gates, {"tok_s": 20.0}, "NVIDIA H100 80GB HBM3")
    assert [r.status for r in on_h100] == ["n/a", "fail", "n/a", "pass"]
    on_3060 = evaluate(gates, {"tok_s": 600.0}, "nvidia geforce rtx 3060")
    assert [r.status for r in on_3060] == ["n/a", "n/a", "pass", "pass"]
    assert summarize(evaluate(gates, {}, "cpu")) == "missing"


@P("P0-000", "absolute-and-relative-thresholds-with-noise-floor")
def test_yaml_file_and_format_errors(tmp_path: Path) -> None:
    path = tmp_path / "P0-003.yaml"
    path.write_text(
        "version: 1\ngates:\n  - metric: rust_ops\n    hardware: cpu\n"
        "    relative: {baseline: py_ops, factor: 10, noise_floor: 0.02}\n    note: 10x\n"
    )
    gates = load_gates(path)
    assert len(gates) == 1 and gates.gates[0].relative is not None
    (result,) = evaluate(gates, {"rust_ops": 9.9, "py_ops": 1.0}, "cpu")
    assert result.status == "pass" and "[10x]" in result.message
    bad_docs = [
        {"version": 2},
        {"gates": [{"metric": "x"}]},
        {"gates": [{"metric": "x", "min": "fast"}]},
        {"gates": [{"metric": "x", "relative": {"factor": 2, "noise_floor": 1.5}}]},
        {"gates": [{"metric": "x", "relative": {"baseline": "y"}}]},
        {"gates": [{"metric": "x", "minimum": 3}]},
        [1, 2],
    ]
    for doc in bad_docs:
        with pytest.raises(GateFormatError, match=r"t\.yaml"):
            parse_gates(doc, "t.yaml")
    path.write_text("gates: [")
    with pytest.raises(GateFormatError, match="invalid YAML"):
        load_gates(path)


@P("P2-005", "cpu-gates-are-keyed-by-cpu-kind")
@P("P2-005", "failing-tests-the-int4-gemv-the-c-decode-step-isa-levels-kind-keyed-gates")
def test_cpu_rules_keyed_by_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    from cardgate import hardware

    gates = _gates(
        {"metric": "tok_s", "hardware": "cpu", "min": 10},
        {"metric": "tok_s", "hardware": "cpu:amd-epyc", "min": 100},
        {"metric": "tok_s", "hardware": "cpu:intel-*", "min": 50},
        {"metric": "tok_s", "hardware": "*EPYC*", "min": 1000},
    )
    statuses = {key: [r.status for r in evaluate(gates, {"tok_s": 60.0}, key)]
                for key in ("cpu:amd-epyc", "cpu:intel-amx", "cpu", "NVIDIA H100")}  # fmt: skip
    assert statuses == {
        "cpu:amd-epyc": ["pass", "fail", "n/a", "n/a"],
        "cpu:intel-amx": ["pass", "n/a", "pass", "n/a"],
        "cpu": ["pass", "n/a", "n/a", "n/a"],  # a record from before the kinds
        "NVIDIA H100": ["n/a", "n/a", "n/a", "n/a"],
    }
    amd = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f avx512_vnni\n"
    intel = "vendor_id\t: GenuineIntel\nflags\t\t: avx2 avx512f amx_tile amx_int8\n"
    assert hardware.cpu_kind(amd) == "amd-epyc"
    assert hardware.cpu_kind(intel) == "intel-amx"
    assert hardware.cpu_kind(intel.replace(" amx_tile amx_int8", "")) == "x86-avx512"
    assert hardware.cpu_kind("flags : sse2 avx2\n") == "x86-avx2"
    monkeypatch.setattr(hardware, "gpu_info", lambda: {})
    assert hardware.hardware_key() == f"cpu:{hardware.cpu_kind()}"


def test_one_hardware_key_for_gate_and_benchmarks(monkeypatch: pytest.MonkeyPatch) -> None:
    common = pytest.importorskip("minisgl.benchmark.common", exc_type=ImportError)
    from cardgate import hardware

    monkeypatch.setattr(hardware, "gpu_info", lambda: {"gpu_name": "NVIDIA H100 80GB HBM3"})
    assert common.hardware_key is hardware.hardware_key
    assert common.hardware_key() == "NVIDIA H100 80GB HBM3"
