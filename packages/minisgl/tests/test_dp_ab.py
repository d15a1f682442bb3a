"""`python -m minisgl.benchmark.dp_ab`: the arms it starts (servers stubbed out)."""

from __future__ import annotations

import json

import pytest

from minisgl.benchmark import dp_ab


@pytest.fixture
def started(monkeypatch) -> list[list[str]]:
    """The server flags of every run; each run reports fixed numbers."""
    flags_seen: list[list[str]] = []

    def fake_run_arm(model, flags, backend, bench, tmp):
        flags_seen.append(list(flags))
        dp = int(flags[flags.index("--dp") + 1])
        observed = {"prefix_hit_rate": 0.7, "routed": [10.0] * dp, "replica_hit_rate": [0.7] * dp}
        return {"output_tok_s": 100.0 * dp, "request_s": 1.0 * dp}, observed

    monkeypatch.setattr(dp_ab, "run_arm", fake_run_arm)
    return flags_seen


def test_the_simulated_device_gives_each_replica_a_device_of_its_own(started, tmp_path):
    out = tmp_path / "dp.json"
    dp_ab.main(["--dp", "2", "--repeats", "1", "--sim-device", "0.5,0.002", "--out", str(out)])
    assert len(started) == 2
    for flags in started:
        assert flags[flags.index("--sim-device") + 1] == "0.5,0.002"
        assert "--threads" not in flags  # no model runs: no core budget to split
    doc = json.loads(out.read_text())
    assert doc["sim_device"] == "0.5,0.002"
    assert doc["arms"] == {"dp1": "--dp 1", "dp2": "--dp 2"}
    assert doc["speedup_output_tok_s"] == pytest.approx(2.0)


def test_without_the_simulated_device_the_cores_are_shared(started, tmp_path):
    out = tmp_path / "dp.json"
    dp_ab.main(["--dp", "2", "--repeats", "1", "--threads-total", "2", "--out", str(out)])
    by_dp = {f[f.index("--dp") + 1]: f for f in started}
    assert by_dp["1"][by_dp["1"].index("--threads") + 1] == "2"
    assert by_dp["2"][by_dp["2"].index("--threads") + 1] == "1"
    assert "--sim-device" not in by_dp["2"]
    assert json.loads(out.read_text())["sim_device"] is None


def test_the_record_names_the_machine_and_the_commit(started, tmp_path):
    """Issue 35: every benchmark record names the CPU kind and its ISA features (a dp figure on
    2 shared cores says nothing of another machine), the commit and the command line."""
    out = tmp_path / "dp.json"
    argv = ["--dp", "2", "--repeats", "1", "--out", str(out)]
    dp_ab.main(argv)
    doc = json.loads(out.read_text())
    assert doc["schema_version"] >= 1 and doc["created"] and doc["argv"] == argv
    assert doc["git"]["commit"]
    machine = doc["machine"]
    assert machine["cpu_kind"] and machine["isa"]["features"] is not None
    assert machine["cpu_count_logical"] >= 1
