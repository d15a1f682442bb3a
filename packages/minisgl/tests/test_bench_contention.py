"""`python -m minisgl.benchmark.contention`: one request's latency quiet and beside spinning
processes, threads adapted and fixed, in one record (issue 59 item 4)."""

from __future__ import annotations

import json

import pytest

from minisgl.benchmark import contention
from minisgl.benchmark.contention import Timing, summarize


def test_summarize_gives_medians_ratios_and_the_fair_share() -> None:
    t = [Timing(arm, phase, r, s, 14, 0.0)
         for arm, phase, r, s in [("adapt", "quiet", 0, 0.1), ("adapt", "quiet", 1, 0.3),
                                  ("adapt", "quiet", 2, 0.2), ("adapt", "loaded", 0, 0.6),
                                  ("fixed", "quiet", 0, 0.2), ("fixed", "loaded", 0, 2.4)]]  # fmt: skip
    got = summarize(t, cores=2, load=4, threads=2)
    assert got["fair_share_ratio"] == 3.0
    assert got["adapt"] == pytest.approx(
        {"quiet_s": 0.2, "loaded_s": 0.6, "loaded_over_quiet": 3.0}
    )
    assert got["fixed"]["loaded_over_quiet"] == pytest.approx(12.0)
    assert got["fixed_over_adapt_loaded"] == pytest.approx(4.0)


def test_the_benchmark_runs_both_arms_quiet_and_loaded(tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "c.json"
    rc = contention.main(["--model-path", str(tiny_model_dir("llama")), "--threads", "2", "--load", "1",
                          "--repeats", "1", "--max-tokens", "3", "--out", str(out)])  # fmt: skip
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["kind"] == "contention" and record["config"]["load"] == 1
    cells = {(t["arm"], t["phase"]) for t in record["timings"]}
    assert cells == {(a, p) for a in ("adapt", "fixed") for p in ("quiet", "loaded")}
    assert all(t["tokens"] == 3 and t["seconds"] > 0 for t in record["timings"])
    assert json.loads(capsys.readouterr().out)["fair_share_ratio"] == pytest.approx(
        (1 + 2) / record["config"]["cores"]
    )
    assert str(tmp_path) not in out.read_text()  # repo-relative / redacted paths only


def test_bad_arguments_are_usage_errors() -> None:
    with pytest.raises(SystemExit) as e:
        contention.main(["--threads", "0"])
    assert e.value.code == 2
