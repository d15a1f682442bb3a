"""Issue 40, class 1: results that contradict themselves are failures, and the plugins and
conftest hooks that could rewrite a result are recorded and refused unless the repo declares
them."""

from __future__ import annotations

import pytest
from cardgate_repo import (
    FAIL,
    IN_PROGRESS_CARD,
    PASS,
    USAGE,
    Repo,
    manifest_of,
    ready,
    summary_of,
)

from cardgate.decide import node_results
from cardgate.outcome import Verdict
from cardgate.run import RunResult, TestPhase

CARD = "P0-007"
RED = "every-class-fails-on-the-gate-before-this-card"
GREEN = "every-class-refused-with-its-reason"

FLAKY_TEST = """\
import pytest

RUNS = []

@pytest.mark.card("T-001", "child-one")
def test_one():
    RUNS.append(1)
    assert len(RUNS) > 1, "fails on its first run"
"""

TURN_FAILURES_TO_PASSES = """\
import pytest

@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        report.outcome = "passed"
    return report
"""

SCALING_METRIC = """\
import pytest
from cardgate.plugin import MetricRecorder

@pytest.fixture
def metric(request):
    recorder = MetricRecorder(request.node)
    return lambda name, value, **kw: recorder(name, value * 100, **kw)
"""


def _run_twice() -> RunResult:
    """A run where one test id ran twice: failed, then passed."""
    phases = tuple(
        TestPhase("t::x", "call", outcome, "", "assertion" if outcome == "failed" else None,
                  False, ())
        for outcome in ("failed", "passed")
    )  # fmt: skip
    return RunResult((), (), 1, False, phases, (), {"x": ("t::x",)}, "cpu:x", ())


def _failed_items(record) -> dict[str, str]:
    return {i["key"]: i["status"] for i in summary_of(record)["items"]}


@pytest.mark.card(CARD, "a-test-id-run-twice-counts-every-result", RED, GREEN)
def test_a_test_run_twice_fails_if_either_run_failed(repo: Repo) -> None:
    ready(repo)
    repo.write("tests/test_flaky.py", FLAKY_TEST)
    repo.commit("a test that fails on its first run only")
    result = repo.gate("--", "--keep-duplicates", "tests/test_flaky.py", "tests/test_flaky.py")
    assert result.ret == USAGE, result.stdout.str()  # issue 61: no caller arguments but -n, -k
    assert (repo.path / IN_PROGRESS_CARD).exists()
    assert node_results(_run_twice()).get("t::x").status is Verdict.FAIL


@pytest.mark.card(CARD, "a-report-that-says-passed-while-the-test-raised-is-a-failure", RED, GREEN)
def test_a_conftest_that_turns_failures_into_passes_fails_the_gate(repo: Repo) -> None:
    ready(repo, impl="False")
    repo.write("tests/conftest.py", TURN_FAILURES_TO_PASSES)
    repo.commit("a conftest that rewrites reports")
    result = repo.gate()
    assert result.ret == FAIL, result.stdout.str()
    out = result.stdout.str()
    assert "tests/test_demo.py::test_one" in out and "raised" in out
    assert "tests/conftest.py" in out  # named as an undeclared hook on reports
    assert _failed_items(repo.evidence()[-1])["child-one"] == "fail"


@pytest.mark.card(
    CARD,
    "plugins-and-conftest-hooks-that-could-touch-reports-are-recorded-and-refused-unless-declared",
    RED,
    GREEN,
)
@pytest.mark.parametrize("how", ["PYTEST_PLUGINS", "-p"])
def test_an_outside_plugin_that_rewrites_reports_is_refused(
    repo: Repo, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    outside = tmp_path_factory.mktemp("outside")
    (outside / "evil_reports.py").write_text(TURN_FAILURES_TO_PASSES)
    monkeypatch.setenv("PYTHONPATH", str(outside))
    ready(repo, impl="False")
    if how == "-p":  # issue 61: refused before anything runs
        result = repo.gate("--", "-p", "evil_reports")
        assert result.ret == USAGE, result.stdout.str()
        assert "not allowed" in result.stderr.str()
        return
    monkeypatch.setenv("PYTEST_PLUGINS", "evil_reports")
    result = repo.gate()
    assert result.ret == FAIL, result.stdout.str()  # the plugin never loads: the test fails
    manifest = manifest_of(repo.evidence()[-1])
    assert not [p for p in manifest.get("plugins", []) if p["name"] == "evil_reports"]
    assert {"PYTEST_PLUGINS", "PYTHONPATH"} <= set(manifest["env_dropped"])


@pytest.mark.card(
    CARD,
    "plugins-and-conftest-hooks-that-could-touch-reports-are-recorded-and-refused-unless-declared",
    RED,
    GREEN,
)
def test_a_declared_conftest_hook_is_recorded_and_accepted(repo: Repo) -> None:
    ready(repo)
    repo.write(
        "tests/conftest.py",
        "import pytest\n\n@pytest.hookimpl(wrapper=True)\n"
        "def pytest_runtest_call(item):\n    return (yield)\n",
    )
    repo.write(
        "pyproject.toml",
        '[tool.pytest.ini_options]\ntestpaths = ["tests"]\npythonpath = ["src"]\n'
        'cardgate_plugins = ["tests/conftest.py"]\n',
    )
    repo.commit("a declared conftest hook")
    result = repo.gate()
    assert result.ret == PASS, result.stdout.str()
    plugins = manifest_of(repo.evidence()[-1]).get("plugins", [])
    mine = [p for p in plugins if p["name"] == "tests/conftest.py"]
    assert mine and mine[0]["allowed"] is True and mine[0]["hooks"] == ["pytest_runtest_call"]


@pytest.mark.card(CARD, "a-redefined-metric-fixture-is-refused", RED, GREEN)
def test_a_conftest_metric_fixture_is_refused(repo: Repo) -> None:
    ready(repo)
    repo.write("tests/conftest.py", SCALING_METRIC)
    repo.write(
        "worklog/gates/T-001.yaml",
        "version: 1\ngates:\n  - metric: ops\n    min: 1000\n",
    )
    repo.commit("a metric fixture that scales every value")
    result = repo.gate()
    assert result.ret == FAIL, result.stdout.str()
    result.stdout.fnmatch_lines(["*metric*fixture*tests/conftest.py*"])


def _failed_with(message: str) -> RunResult:
    phase = TestPhase("t::x", "call", "failed", message, "assertion", False, ())
    return RunResult((), (), 1, False, (phase,), (), {"x": ("t::x",)}, "cpu:x", ())


def test_a_failed_assertions_reason_shows_its_message_and_its_assert_line() -> None:
    """The reason a gate prints and records for a failed test is the failure's first line (the
    exception and its message) with the `assert` line pytest rewrote: a re-run of P2-004 on
    amd-epyc recorded only the innermost explanation of its perplexity check ("where
    <built-in function isfinite> = math.isfinite"), not the values that failed it."""
    message = (
        "AssertionError: (38.693434233653235, 37.501397702397156)\n"
        "assert (True and 38.693434233653235 <= (37.501397702397156 * 1.02))\n"
        " +  where True = <built-in function isfinite>(38.693434233653235)\n"
        " +    where <built-in function isfinite> = math.isfinite"
    )
    reason = node_results(_failed_with(message))["t::x"].reason
    assert reason.startswith("t::x call: AssertionError: (38.693434233653235, 37.50139770239")
    assert "assert (True and 38.693434233653235 <= (37.501397702397156 * 1.02))" in reason
    assert "math.isfinite" not in reason
    plain = node_results(_failed_with("ValueError: bad shape [3, 4]"))["t::x"].reason
    assert plain == "t::x call: ValueError: bad shape [3, 4]"
    bare = node_results(_failed_with("assert 3 == 4\n +  where 3 = len([1, 2, 3])"))["t::x"]
    assert bare.reason == "t::x call: assert 3 == 4"
