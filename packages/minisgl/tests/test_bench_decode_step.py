"""`python -m minisgl.benchmark.decode_step` on a CPU: arms, the launch count, bytes and the
memory floor, the split-KV sweep's naming, bad arguments. (Its torch.profiler by-kernel table
runs on CUDA only: `worklog/baselines/gpu-h200-decode-step-*.json`.)"""

from __future__ import annotations

import json

import pytest

from minisgl.benchmark import decode_step
from minisgl.testing.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model("qwen2", tmp_path_factory.mktemp("m") / "qwen2", seed=0)


def run(model, tmp_path, *extra: str) -> dict:
    out = tmp_path / "step.json"
    argv = ["--model-path", str(model), "--device", "cpu", "--dtype", "float32",
            "--batch", "3", "--context", "12", "--warmup", "1", "--repeats", "3",
            "--out", str(out), *extra]  # fmt: skip
    assert decode_step.main(argv) == 0
    return json.loads(out.read_text())


def test_both_arms_timed_counted_and_bounded(model, tmp_path):
    record = run(model, tmp_path, "--bandwidth-gb-s", "100")
    assert record["tool"] == "decode_step" and record["bandwidth_gb_s"] == 100
    fused, torch_ops = record["results"]["fused"], record["results"]["torch"]
    for arm in (fused, torch_ops):
        assert arm["fused_ops"] is False  # auto keeps the torch ops on a CPU
        assert arm["graphs"] is False and arm["kernel_time"] is None
        assert 0 < arm["step_ms"]["p50"] <= arm["step_ms"]["max"]
        assert arm["kernels"]["source"].startswith("dispatch-mode")
        moved = arm["bytes"]
        assert moved["weights"] > 0 and moved["kv"] > 0
        floor = (moved["weights"] + moved["kv"]) / 100e9 * 1e3
        assert arm["floor_ms"] == pytest.approx(floor, rel=1e-3)
        assert arm["fraction_of_floor"] == pytest.approx(floor / arm["step_ms"]["p50"], rel=1e-2)
    # the same code on a CPU: the same launches, one layer's share of them above one
    assert fused["kernels"]["total"] == torch_ops["kernels"]["total"] > 0
    layers = 2  # write_tiny_model's
    assert fused["kernels"]["per_layer_incl_fixed"] == round(fused["kernels"]["total"] / layers, 2)
    ratio = torch_ops["step_ms"]["p50"] / fused["step_ms"]["p50"]
    assert record["ratios"]["fused_vs_torch_step"] == pytest.approx(ratio, rel=1e-2)


def test_kv_bytes_scale_with_batch_and_context(model, tmp_path):
    small = run(model, tmp_path, "--arms", "torch")["results"]["torch"]["bytes"]
    big = run(model, tmp_path, "--arms", "torch", "--batch", "6", "--context", "24")
    assert big["results"]["torch"]["bytes"]["kv"] == 4 * small["kv"]
    assert big["results"]["torch"]["bytes"]["weights"] == small["weights"]


def test_split_kv_sweep_names_one_result_per_target(model, tmp_path):
    record = run(model, tmp_path, "--arms", "torch", "--kv-programs-per-sm", "2,8")
    assert sorted(record["results"]) == ["torch@pps2", "torch@pps8"]
    from minisgl.attention import triton_backend

    assert triton_backend._PROGRAMS_PER_SM == 2  # restored after the sweep


def test_tile_sweep_crosses_the_split_targets_and_restores_the_knobs(model, tmp_path):
    record = run(model, tmp_path, "--arms", "torch", "--kv-programs-per-sm", "2,4",
                 "--decode-tiles", "64x4,128")  # fmt: skip
    assert sorted(record["results"]) == [
        "torch@pps2@n128w4", "torch@pps2@n64w4", "torch@pps4@n128w4", "torch@pps4@n64w4",
    ]  # fmt: skip
    from minisgl.attention import triton_backend

    assert triton_backend._PROGRAMS_PER_SM == 2 and triton_backend._DECODE_TILE is None


def test_idle_time_splits_launch_gaps_from_host_gaps():
    # kernels [0, 5], [6, 9] (gap 1), [9.5, 12] overlapping none (gap 0.5), then a host pause
    # of 100 before [112, 113]; a kernel inside another's span adds no idle time
    spans = [(6.0, 9.0), (0.0, 5.0), (112.0, 113.0), (9.5, 12.0), (1.0, 2.0)]
    assert decode_step._idle_us(spans, long_us=20.0) == (1.5, 100.0)
    assert decode_step._idle_us([]) == (0.0, 0.0)


def test_an_unknown_arm_is_a_usage_error(model, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        decode_step.main(["--model-path", str(model), "--arms", "fused,inductor"])
    assert exit_.value.code == 2
    assert "inductor" in capsys.readouterr().err


def test_an_arm_that_cannot_run_is_recorded_and_fails_the_run(model, tmp_path):
    out = tmp_path / "bad.json"
    code = decode_step.main(["--model-path", str(tmp_path / "missing"), "--device", "cpu",
                             "--arms", "torch", "--out", str(out)])  # fmt: skip
    assert code == 1
    assert "error" in json.loads(out.read_text())["results"]["torch"]
