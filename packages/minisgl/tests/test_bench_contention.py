"""`python -m minisgl.benchmark.contention`: one request's latency quiet and beside spinning
processes, each arm (an OpenMP wait policy, the thread adaptation) a process of its own, in one
record (issue 59 item 4)."""

from __future__ import annotations

import json

import pytest

from minisgl.benchmark import contention
from minisgl.benchmark.contention import Timing, parse_arm, summarize


def test_summarize_gives_medians_ratios_and_the_fair_share() -> None:
    t = [Timing(arm, phase, r, s, 14, 0.0)
         for arm, phase, r, s in [("adapt", "quiet", 0, 0.1), ("adapt", "quiet", 1, 0.3),
                                  ("adapt", "quiet", 2, 0.2), ("adapt", "loaded", 0, 0.6),
                                  ("active", "quiet", 0, 0.2), ("active", "loaded", 0, 2.4)]]  # fmt: skip
    got = summarize(t, cores=2, load=4, threads=2)
    assert got["fair_share_ratio"] == 3.0
    assert got["adapt"] == pytest.approx(
        {"quiet_s": 0.2, "loaded_s": 0.6, "loaded_over_quiet": 3.0}
    )
    assert got["active"]["loaded_over_quiet"] == pytest.approx(12.0)


def test_arms_parse_by_name_or_environment() -> None:
    assert parse_arm("passive") == ("passive", {"OMP_WAIT_POLICY": "PASSIVE"})
    assert parse_arm("s1k=GOMP_SPINCOUNT=1000,OMP_WAIT_POLICY=ACTIVE") == (
        "s1k", {"GOMP_SPINCOUNT": "1000", "OMP_WAIT_POLICY": "ACTIVE"})  # fmt: skip
    for bad in ("", "nope", "x=GOMP_SPINCOUNT", "=A=1"):
        with pytest.raises(ValueError, match="--arm"):
            parse_arm(bad)


def test_an_arm_gets_no_openmp_setting_it_did_not_ask_for(monkeypatch) -> None:
    """The parent imported minisgl, which set OMP_WAIT_POLICY and GOMP_SPINCOUNT in its own
    environment: an arm's process must not inherit them (the "passive" arm ran with the
    parent's 1000 spins, the "active" one would have)."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    monkeypatch.setenv("KEEP_ME", "1")
    env = contention.arm_env({"OMP_WAIT_POLICY": "ACTIVE"})
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in env
    assert env["KEEP_ME"] == "1"
    default = contention.arm_env({})
    assert "OMP_WAIT_POLICY" not in default and "GOMP_SPINCOUNT" not in default
    assert contention.arm_env({"GOMP_SPINCOUNT": "0"})["GOMP_SPINCOUNT"] == "0"


def test_the_benchmark_runs_each_arm_quiet_and_loaded(tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "c.json"
    rc = contention.main(["--model-path", str(tiny_model_dir("llama")), "--threads", "2",
                          "--load", "1", "--repeats", "2", "--max-tokens", "3", "--out", str(out),
                          "--arm", "passive", "--arm", "spin=GOMP_SPINCOUNT=1000"])  # fmt: skip
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["kind"] == "contention" and record["config"]["load"] == 1
    cells = sorted((t["arm"], t["phase"], t["repeat"]) for t in record["timings"])
    assert cells == sorted((a, p, r) for a in ("passive", "spin") for p in ("quiet", "loaded")
                           for r in (0, 1))  # fmt: skip
    assert all(t["tokens"] == 3 and t["seconds"] > 0 for t in record["timings"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["fair_share_ratio"] == pytest.approx((1 + 2) / record["config"]["cores"])
    assert set(summary) == {"fair_share_ratio", "passive", "spin"}
    assert str(tmp_path) not in out.read_text()  # repo-relative / redacted paths only


def test_bad_arguments_are_usage_errors() -> None:
    for argv in (["--threads", "0"], ["--arm", "nope"]):
        with pytest.raises(SystemExit) as e:
            contention.main(argv)
        assert e.value.code == 2


def test_the_other_arms_are_stopped_while_one_is_timed() -> None:
    """The arms' processes live side by side: an ACTIVE arm's idle threads spin for minutes
    after each request, and took a core from the arm being timed. `paused` stops the others
    (SIGSTOP) for the duration and resumes them after."""
    import subprocess
    import sys
    import time

    import psutil

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(2)]  # fmt: skip

    def stopped(want: bool) -> list[bool]:
        """The processes' states once all are `want`, or after 5 s (signals arrive async)."""
        deadline = time.monotonic() + 5
        while True:
            states = [psutil.Process(p.pid).status() == psutil.STATUS_STOPPED for p in procs]
            if all(x == want for x in states) or time.monotonic() > deadline:
                return states
            time.sleep(0.01)

    try:
        with contention.paused(procs):
            assert stopped(True) == [True, True]
        assert stopped(False) == [False, False]
    finally:
        for p in procs:
            p.kill()
            p.wait()
