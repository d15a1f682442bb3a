"""`minisgl.benchmark.kind_matrix` (issue 59 item 3): one record per CPU kind in
`worklog/kinds/<kind>.json`, an entry per commit: the suite's outcome parsed from pytest's
final summary line and its FAILED / ERROR lines, and the speed ratios of the baseline records
the CPU-kind session wrote at that commit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minisgl.benchmark import kind_matrix as km

ROOT = Path(__file__).resolve().parents[1]

INTEL_AMX_LOG = """\
tests/test_w8a8_decode_step.py:326: AssertionError
=========================== short test summary info ============================
FAILED tests/test_w8a8.py::test_the_embedded_model_in_w8a8_answers_paris_within_2pc_perplexity
FAILED tests/test_w8a8_decode_step.py::test_the_w8a8_c_step_gives_the_modules_logits[llama-16]
FAILED tests/test_w8a8_decode_step.py::test_x[mistral-16] - AssertionError: largest difference
ERROR tests/test_server.py::test_boot - TimeoutError
=========== 5 failed, 1451 passed, 42 skipped, 1 error in 1358.90s (0:22:38) ============
nox > Command pytest -m 'not rust_ext' -n auto failed with exit code 1
nox > Session tests failed.
"""


@pytest.mark.parametrize(
    ("line", "want"),
    [
        (
            "5 failed, 1451 passed, 42 skipped in 1358.90s",
            ("failed", 1451, 5, 42, 0, 1358.90),
        ),
        (
            "=========== 5 failed, 1451 passed, 42 skipped in 1358.90s (0:22:38) ============",
            ("failed", 1451, 5, 42, 0, 1358.90),
        ),
        ("===== 1498 passed in 610.02s (0:10:10) =====", ("passed", 1498, 0, 0, 0, 610.02)),
        (
            "\x1b[32m1490 passed\x1b[0m, \x1b[33m8 skipped\x1b[0m, 3 warnings in 12.5s",
            ("passed", 1490, 0, 8, 0, 12.5),
        ),
        ("== 3 passed, 2 errors in 1.00s ==", ("failed", 3, 0, 0, 2, 1.0)),
        ("= 1 passed, 1 error in 0.50s =", ("failed", 1, 0, 0, 1, 0.5)),
        ("============ no tests ran in 0.01s ============", ("no tests", 0, 0, 0, 0, 0.01)),
    ],
)
def test_a_pytest_summary_line_gives_the_counts(line, want):
    got = km.parse_summary(line)
    assert got is not None
    assert (got.outcome, got.passed, got.failed, got.skipped, got.errors) == want[:5]
    assert got.duration_s == pytest.approx(want[5])


@pytest.mark.parametrize(
    "line", ["tests/test_x.py::test_y PASSED", "nox > Session tests failed.", "42 skipped", ""]
)
def test_a_line_that_is_no_summary_gives_none(line):
    assert km.parse_summary(line) is None


def test_a_suite_log_gives_its_last_summary_and_the_failing_node_ids():
    suite = km.parse_suite_log("===== 2 passed in 1.00s =====\n" + INTEL_AMX_LOG)
    assert (suite.outcome, suite.passed, suite.failed, suite.skipped, suite.errors) == (
        "failed",
        1451,
        5,
        42,
        1,
    )
    assert suite.failed_ids == (
        "tests/test_w8a8.py::test_the_embedded_model_in_w8a8_answers_paris_within_2pc_perplexity",
        "tests/test_w8a8_decode_step.py::test_the_w8a8_c_step_gives_the_modules_logits[llama-16]",
        "tests/test_w8a8_decode_step.py::test_x[mistral-16]",
        "tests/test_server.py::test_boot",
    )


def test_a_suite_log_without_a_summary_is_an_error_not_a_pass():
    suite = km.parse_suite_log("nox > Running session tests\nnox > Session tests failed.\n")
    assert suite.outcome == "error"
    assert (suite.passed, suite.failed) == (0, 0)


def test_ratios_and_start_up_come_from_the_baseline_records():
    base = ROOT / "worklog" / "baselines"
    single = km.from_baseline(
        json.loads((base / "cpu-speed-smollm2-single-amd-epyc-20261129.json").read_text())
    )
    assert single.commit.startswith("540bf4e")
    assert single.ratios["single.minisgl-default/llamacpp"] == pytest.approx(1.5288, abs=1e-3)
    assert single.values["single.llamacpp.output_tok_s"] == pytest.approx(100.70, abs=1e-2)
    batched = km.from_baseline(
        json.loads((base / "cpu-speed-smollm2-batched-amd-epyc-20261129.json").read_text())
    )
    assert batched.ratios["many-short.minisgl-w8a8/hf-bf16"] == pytest.approx(3.4436, abs=1e-3)
    start = km.from_baseline(
        json.loads((base / "startup-cpu-smollm2-x86-avx2-20261129.json").read_text())
    )
    assert start.commit.startswith("734ec2e") and start.dirty
    assert start.values["startup.cold.process_s"] == pytest.approx(20.96, abs=1e-2)
    assert start.values["startup.warm.process_s"] == pytest.approx(8.00, abs=1e-2)  # fmt: skip


def _entry(commit: str, utc: str, **kw) -> km.Entry:
    return km.Entry(commit=commit, utc=utc, source="test", **kw)


def test_a_kind_record_round_trips(tmp_path):
    suite = km.parse_suite_log(INTEL_AMX_LOG)
    entries = [
        _entry("a" * 40, "2026-12-06T01:00:00Z", suite=suite, ratios={"x/y": 1.5},
               values={"startup.cold.process_s": 18.0}, baselines=("worklog/baselines/b.json",),
               steps={"suite": 1, "start": 0}, notes="n"),
        _entry("b" * 40, "2026-12-06"),
    ]  # fmt: skip
    path = tmp_path / "worklog" / "kinds" / "intel-amx.json"
    km.write_kind(path, "intel-amx", entries)
    data = json.loads(path.read_text())
    assert data["kind"] == "intel-amx" and data["schema_version"] == km.SCHEMA_VERSION
    assert data["entries"][0]["suite"]["failed_ids"][0].startswith("tests/test_w8a8.py::")
    assert data["entries"][1]["suite"] is None
    kind, back = km.read_kind(path)
    assert kind == "intel-amx" and back == entries


def test_an_entry_at_a_commit_already_recorded_is_merged_into_it():
    first = _entry("a" * 40, "2026-12-06T01:00:00Z", suite=km.parse_summary("3 passed in 1.0s"),
                   ratios={"r1": 1.0, "r2": 2.0}, steps={"suite": 0})  # fmt: skip
    other = _entry("b" * 40, "2026-12-06T02:00:00Z")
    again = _entry("a" * 40, "2026-12-06T03:00:00Z", ratios={"r2": 2.5}, steps={"single": 0})
    entries = km.add_entry(km.add_entry(km.add_entry([], first), other), again)
    assert [e.commit[0] for e in entries] == ["b", "a"]  # oldest first
    merged = entries[1]
    assert merged.suite == first.suite  # a run without the suite keeps the recorded one
    assert merged.ratios == {"r1": 1.0, "r2": 2.5}
    assert merged.steps == {"suite": 0, "single": 0}
    assert merged.utc == "2026-12-06T03:00:00Z"


def test_a_record_holds_no_absolute_path(tmp_path):
    path = tmp_path / "k.json"
    entry = _entry("a" * 40, "2026-12-06", baselines=(str(ROOT / "worklog/baselines/x.json"),))
    with pytest.raises(ValueError, match="repository-relative"):
        km.write_kind(path, "amd-epyc", [entry])


@pytest.mark.parametrize("kind", ["intel-amx", "amd-epyc", "x86-avx2"])
def test_the_seeded_records_read_back_and_name_their_source(kind):
    name, entries = km.read_kind(ROOT / "worklog" / "kinds" / f"{kind}.json")
    assert name == kind and entries
    for entry in entries:
        assert entry.source and len(entry.commit) >= 7
        text = json.dumps(km.entry_json(entry))
        assert "/work/" not in text and "/home/" not in text


CI_LOG = """== lint
nox > Session lint was successful.
== rust (fmt, clippy, test)
test result: ok. 61 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 6.39s
== tests (the README's test command)
nox > pytest -m 'not rust_ext' -n auto --durations=25
=========== 2027 passed, 42 skipped, 2 warnings in 950.22s (0:15:50) ===========
nox > the isa_paths tests again with MINISGL_CPU_ISA=avx512
======================= 225 passed, 2 skipped in 57.11s ========================
nox > the isa_paths tests again with MINISGL_CPU_ISA=avx2
================= 209 passed, 18 skipped in 153.95s (0:02:33) ==================
nox > pytest -m rust_ext -n auto --durations=25
======================= {rust_ext} in 61.00s ========================
nox > Session tests was successful in 1300 seconds.
== docs (the site: mkdocs build --strict, checked in headless Chromium)
5 passed in 13.44s
"""


@pytest.mark.parametrize("rust_ext", ["118 passed", "1 failed, 117 passed"])
def test_a_ci_log_gives_the_test_commands_passes_summed(rust_ext):
    """`bash .ci/run`'s whole log: the README's test command is several pytest passes (the
    suite, the isa_paths passes at lower ISA levels, the rust_ext tests), summed; the docs
    step's own pytest run after it is not the suite (it was read as the suite's 5 tests)."""
    suite = km.parse_suite_log(CI_LOG.format(rust_ext=rust_ext))
    failed = rust_ext.startswith("1 failed")
    assert suite.outcome == ("failed" if failed else "passed")
    assert (suite.passed, suite.failed, suite.skipped) == (2027 + 225 + 209 + 117 + (not failed),
                                                           int(failed), 42 + 2 + 18)  # fmt: skip
    assert suite.duration_s == pytest.approx(950.22 + 57.11 + 153.95 + 61.0)
