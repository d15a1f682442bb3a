from __future__ import annotations

import json

import pytest
from cardgate_repo import Repo

from cardgate.hardware import cpu_kind

P = pytest.mark.card


def _report(repo: Repo, name: str = "report.json") -> dict:
    return json.loads((repo.path / name).read_text())


@P("P0-000", "card-marker-binds-tests-by-key-or-exact-text")
def test_bindings_by_key_and_text_are_reported(repo: Repo) -> None:
    repo.card()
    repo.tests()
    result = repo.pytester.runpytest("--cardgate-report=report.json")
    result.assert_outcomes(passed=3)
    report = _report(repo)
    one = [t for t in report["tests"] if t["nodeid"].endswith("test_one")]
    assert [t["when"] for t in one] == ["setup", "call", "teardown"]
    assert one[1]["items"] == [
        "T-001::child-one",
        "T-001::failing-test-first",
        "T-001::passes-now",
    ]
    unrelated = [t for t in report["tests"] if t["nodeid"].endswith("test_unrelated")]
    assert unrelated[0]["items"] == []


@P("P0-000", "card-marker-binds-tests-by-key-or-exact-text")
def test_card_option_deselects_unbound_tests(repo: Repo) -> None:
    repo.card()
    repo.tests()
    result = repo.pytester.runpytest("--cardgate-card=T-001", "--cardgate-report=r.json")
    result.assert_outcomes(passed=2, deselected=1)
    only = repo.pytester.runpytest("--cardgate-card=T-001", "--cardgate-items=parent-thing")
    only.assert_outcomes(passed=2, deselected=1)  # children of the parent item count
    narrow = repo.pytester.runpytest("--cardgate-card=T-001", "--cardgate-items=child-two")
    narrow.assert_outcomes(passed=1, deselected=2)
    other = repo.pytester.runpytest("--cardgate-card=X-001")
    other.assert_outcomes(deselected=3)


@P("P0-000", "unknown-card-or-item-is-an-error")
@pytest.mark.parametrize(
    ("marker", "expected"),
    [
        ('"T-404", "x"', "*unknown card 'T-404' (known cards: T-001)*"),
        ('"T-001", "no such item"', "*card T-001 has no item 'no such item' (items: parent-*"),
        ('"T-001", "looked-at-it"', "*T-001::looked-at-it is a (manual) item*"),
        ('"T-001"', "*card('T-001') names no item*"),
    ],
)
def test_bad_binding_is_a_collection_error(repo: Repo, marker: str, expected: str) -> None:
    repo.card()
    repo.write(
        "tests/test_bad.py",
        f"import pytest\n\n@pytest.mark.card({marker})\ndef test_x():\n    pass\n",
    )
    result = repo.pytester.runpytest()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*cardgate binding errors:*", expected])


@P("P0-000", "results-and-metrics-collected-under-xdist")
def test_xdist_workers_report_to_the_controller(repo: Repo) -> None:
    repo.card()
    repo.tests(ops=123.5)
    result = repo.pytester.runpytest_subprocess(
        "-n", "2", "--cardgate-card=T-001", "--cardgate-report=report.json"
    )
    result.assert_outcomes(passed=2)
    report = _report(repo)
    assert {t["nodeid"] for t in report["tests"]} == {
        "tests/test_demo.py::test_one",
        "tests/test_demo.py::test_two",
    }
    (teardown,) = [
        t for t in report["tests"] if t["nodeid"].endswith("test_two") and t["when"] == "teardown"
    ]
    assert teardown["items"] == ["T-001::child-two"]
    assert [(m["name"], m["value"], m["unit"]) for m in teardown["metrics"]] == [
        ("ops", 123.5, "ops/s"),
        ("base_ops", 10.0, "ops/s"),
    ]
    assert report["hardware"] == f"cpu:{cpu_kind()}" and report["card"] == "T-001"


@P("P0-000", "gpu-tests-skip-without-cuda-as-missing-evidence")
def test_gpu_marker_skips_without_cuda(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    repo.card()
    repo.write(
        "tests/test_gpu.py",
        "import pytest, sys\n\n@pytest.mark.gpu\n@pytest.mark.card('T-001', 'child-one')\n"
        "def test_cuda():\n    assert False, 'must not run'\n\n"
        "def test_torch_not_imported():\n    assert 'torch' not in sys.modules\n",
    )
    result = repo.pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(skipped=1, passed=1)
    result.stdout.fnmatch_lines(["*gpu: no CUDA device (missing evidence)*"])
    monkeypatch.setenv("CARDGATE_GPU", "1")
    forced = repo.pytester.runpytest_subprocess("-k", "cuda")
    forced.assert_outcomes(failed=1)


def test_requires_marker_skips_without_the_module_as_missing_evidence(repo: Repo) -> None:
    """`requires(module, install)`: a test that needs an optional package (the llama.cpp arm of
    a benchmark) is skipped where it cannot be imported, and the reason says how to get it;
    a gate holds on that skip like on a GPU test without CUDA."""
    repo.card()
    repo.write(
        "tests/test_opt.py",
        "import pytest\n\n"
        "@pytest.mark.requires('no_such_module_xyz', 'pip install xyz')\n"
        "@pytest.mark.card('T-001', 'child-one')\n"
        "def test_needs_xyz():\n    assert False, 'must not run'\n\n"
        "@pytest.mark.requires('json', 'stdlib')\n"
        "def test_needs_json():\n    assert False, 'runs: json imports'\n\n"
        "@pytest.mark.requires()\n"
        "def test_bad_marker():\n    pass\n",
    )
    result = repo.pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(skipped=1, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*requires(module, install) needs a module name*",
            "*requires no_such_module_xyz (missing evidence): pip install xyz*",
        ]
    )


def test_gate_only_marker_runs_under_the_card_gate_or_when_asked(repo: Repo) -> None:
    """`gate_only`: a long benchmark runs when its card is gated (`--cardgate-card`) or with
    `--cardgate-gate-only`, and is skipped elsewhere (the plain test suite), the reason saying
    how to run it; a gate that still sees the skip holds on it as missing evidence."""
    repo.card()
    repo.write(
        "tests/test_long.py",
        "import pytest\n\n"
        "@pytest.mark.gate_only\n"
        "@pytest.mark.bench\n"
        "@pytest.mark.card('T-001', 'child-one')\n"
        "def test_long_bench():\n    assert False, 'ran'\n\n"
        "@pytest.mark.gate_only('not a flag')\n"
        "def test_bad_marker():\n    pass\n",
    )
    plain = repo.pytester.runpytest_subprocess("-rs", "tests/test_long.py::test_long_bench")
    plain.assert_outcomes(skipped=1)
    plain.stdout.fnmatch_lines(
        ["*gate_only (missing evidence): runs under nox -s card -- T-001 or --cardgate-gate-only*"]
    )
    gated = repo.pytester.runpytest_subprocess("--cardgate-card=T-001", "tests/test_long.py")
    gated.assert_outcomes(failed=1, deselected=1)
    gated.stdout.fnmatch_lines(["*AssertionError: ran*"])
    asked = repo.pytester.runpytest_subprocess("--cardgate-gate-only", "tests/test_long.py")
    asked.assert_outcomes(failed=1, errors=1)
    asked.stdout.fnmatch_lines(["*gate_only takes no arguments*"])


@P("P0-000", "metric-fixture-records-metrics")
def test_metric_fixture_rules(repo: Repo) -> None:
    repo.card()
    repo.write(
        "tests/test_m.py",
        """
        import math, pytest

        def test_not_bench(metric):
            pass

        @pytest.mark.bench
        def test_nan(metric):
            with pytest.raises(ValueError, match="not finite"):
                metric("x", math.nan)
            assert metric("lat_ms", 3, unit="ms", higher_is_better=False) == 3.0
        """,
    )
    result = repo.pytester.runpytest("--cardgate-report=r.json")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*metric fixture is for tests marked @pytest.mark.bench*"])
    (teardown,) = [t for t in _report(repo, "r.json")["tests"] if t["when"] == "teardown"][-1:]
    assert teardown["metrics"] == [
        {"name": "lat_ms", "value": 3.0, "unit": "ms", "higher_is_better": False}
    ]


@P("P0-000", "parity-json-evidence-checked")
def test_parity_fixture(repo: Repo) -> None:
    repo.card()
    repo.write("good.json", '{"parity_passed": true, "mismatches": 0}')
    repo.write("bad.json", '{"parity_passed": true, "mismatches": 3}')
    repo.write(
        "tests/test_p.py",
        "def test_good(parity):\n    parity('good.json')\n\n"
        "def test_bad(parity):\n    parity('bad.json')\n",
    )
    result = repo.pytester.runpytest("--cardgate-report=r.json")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*parity failed for bad.json: mismatches = 3, expected 0*"])
    metrics = [m for t in _report(repo, "r.json")["tests"] for m in t["metrics"]]
    assert metrics[0]["name"] == "parity_mismatches" and metrics[0]["value"] == 0.0
