"""Issue 61, part A (card P0-008): the gate runs the commit it records, in a room read from
git's raw objects, in an environment it builds, with pytest options from the committed
configuration only; a red run with a failed check is no red record; the GPU key needs two
sources that agree."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from cardgate_repo import FAIL, HOLD, IN_PROGRESS_CARD, PASS, USAGE, Repo, manifest_of, ready

from cardgate import decide, hardware, inventory
from cardgate.outcome import GateUsageError, Verdict
from cardgate.preflight import GateOptions, preflight
from cardgate.provenance import inventory_checks
from cardgate.run import Inventory

CARD = "P0-008"
RED = "every-mechanism-fails-on-the-gate-before-this-card"
GREEN = "every-mechanism-refused-with-its-reason"
ROOM = "the-gate-runs-a-room-read-from-the-commit-s-raw-objects"
IMPORTS_IMPL = '__import__("impl").OK'


def _with_impl(repo: Repo, ok: str) -> str:
    repo.card(tdd=False)
    repo.tests(impl=IMPORTS_IMPL, tdd=False)
    repo.write("src/impl.py", f"OK = {ok}\n")
    return repo.commit(f"the commit's implementation says {ok}")


PLAIN_TESTS = """\
import pytest


@pytest.mark.card("T-001", "child-one")
def test_one():
    pass


@pytest.mark.card("T-001", "child two")
def test_two():
    pass
"""


def _plain(repo: Repo) -> str:
    """A card whose bound tests pass and record no metric."""
    repo.card(tdd=False)
    repo.write("tests/test_demo.py", PLAIN_TESTS)
    return repo.commit("a card with passing tests")


def _items(record: Path) -> dict[str, str]:
    summary = json.loads((record / "summary.json").read_text())
    return {i["key"]: i["status"] for i in summary["items"]}


def _out(result: pytest.RunResult) -> str:
    return result.stdout.str() + result.stderr.str()


# --- the clean room ----------------------------------------------------------------------------


@pytest.mark.card(CARD, ROOM, RED, GREEN)
def test_a_clean_filter_does_not_change_what_runs(repo: Repo) -> None:
    _with_impl(repo, ok="0")
    (repo.path / ".git/info/attributes").write_text("impl.py filter=flip\n")
    repo.git("config", "filter.flip.clean", "sed s/1/0/")
    repo.write("src/impl.py", "OK = 1\n")  # same size: git status hashes it through the filter
    assert repo.status() == ""
    result = repo.gate()
    assert result.ret == FAIL, _out(result)
    assert _items(repo.evidence()[-1])["child-one"] == "fail"


@pytest.mark.card(CARD, ROOM, RED, GREEN)
def test_a_replace_ref_does_not_change_what_runs(repo: Repo) -> None:
    bad = _with_impl(repo, ok="False")
    repo.write("src/impl.py", "OK = True\n")
    repo.commit("a working implementation")
    tree = repo.git("rev-parse", "HEAD^{tree}")
    good = repo.git("commit-tree", tree, "-m", "replacement")
    repo.git("reset", "-q", "--soft", bad)
    repo.git("replace", bad, good)  # locally, the commit now reads as the working tree
    assert repo.status() == ""
    result = repo.gate()
    assert result.ret == FAIL, _out(result)
    assert manifest_of(repo.evidence()[-1])["commit"] == bad
    assert _items(repo.evidence()[-1])["child-one"] == "fail"


@pytest.mark.card(CARD, ROOM, RED, GREEN)
def test_a_bound_test_left_off_disk_by_sparse_checkout_runs(repo: Repo) -> None:
    ready(repo)
    repo.write(
        "tests/more/test_hidden.py",
        'import pytest\n\n@pytest.mark.card("T-001", "child-one")\n'
        "def test_hidden():\n    assert False, 'the committed test fails'\n",
    )
    repo.commit("a failing bound test")
    repo.git("sparse-checkout", "set", "--no-cone", "/*", "!/tests/more/")
    assert not (repo.path / "tests/more/test_hidden.py").exists()
    assert repo.status() == ""
    result = repo.gate()
    assert result.ret == FAIL, _out(result)
    assert "test_hidden" in result.stdout.str()


@pytest.mark.card(CARD, ROOM, RED, GREEN)
def test_ignored_files_stay_out_of_the_room_and_no_path_is_recorded(repo: Repo) -> None:
    _plain(repo)
    repo.write(".gitignore", "__pycache__/\n.hypothesis/\n/stdout\n/stderr\nlocal.txt\n")
    repo.write("tests/local.txt", "an ignored file beside the tests\n")
    repo.write(
        "tests/test_room.py",
        "import pathlib\nimport pytest\n\n"
        '@pytest.mark.card("T-001", "child-one")\n'
        "def test_no_ignored_file():\n"
        '    assert not (pathlib.Path(__file__).parent / "local.txt").exists()\n',
    )
    head = repo.commit("a test that sees ignored files")
    result = repo.gate()
    assert result.ret == PASS, _out(result)
    manifest = manifest_of(repo.evidence()[-1])
    assert manifest["clean_room"]["commit"] == head
    assert manifest["clean_room"]["files"] >= 5
    text = json.dumps(manifest)
    assert str(repo.path) not in text and "cardgate-room" not in text


@pytest.mark.card(CARD, "gates-paths-outside-the-repository-are-refused", RED, GREEN)
def test_a_gates_header_outside_the_repository_is_a_usage_error(
    repo: Repo, tmp_path_factory: pytest.TempPathFactory
) -> None:
    outside = tmp_path_factory.mktemp("outside_gates") / "gates.yaml"
    outside.write_text("version: 1\ngates: []\n")
    ready(repo)
    card = repo.path / IN_PROGRESS_CARD
    card.write_text(
        card.read_text().replace("Depends on: none", f"Depends on: none\nGates: {outside}")
    )
    repo.commit("Gates: names a file outside the repository")
    result = repo.gate()
    assert result.ret == USAGE, _out(result)
    assert "outside the repository" in _out(result)
    assert not repo.evidence()


# --- the environment ------------------------------------------------------------------------


@pytest.mark.card(CARD, "inherited-python-and-pytest-variables-are-dropped", RED, GREEN)
def test_an_implementation_only_on_pythonpath_does_not_run(
    repo: Repo, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path_factory.mktemp("pythonpath")
    (outside / "impl.py").write_text("OK = True\n")
    repo.card(tdd=False)
    repo.tests(impl=IMPORTS_IMPL, tdd=False)
    repo.commit("tests only")
    monkeypatch.setenv("PYTHONPATH", str(outside))
    monkeypatch.setenv("PYTHONSTARTUP", str(outside / "impl.py"))
    monkeypatch.setenv("CARDGATE_ANYTHING", "1")
    result = repo.gate()
    assert result.ret == FAIL, _out(result)
    manifest = manifest_of(repo.evidence()[-1])
    assert manifest["environment"]["PYTHONPATH"] == ""
    assert {"PYTHONPATH", "PYTHONSTARTUP", "CARDGATE_ANYTHING"} <= set(manifest["env_dropped"])
    assert "PYTHONPATH" not in manifest["env"]


@pytest.mark.card(CARD, "pth-files-and-pytest11-plugins-are-inventoried", RED, GREEN)
def test_a_pytest11_plugin_from_a_dist_info_on_pythonpath_does_not_load(
    repo: Repo, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path_factory.mktemp("fake_dist")
    (outside / "fake_impl_plugin.py").write_text(
        "import sys, types\n\n"
        "def pytest_configure(config):\n"
        "    sys.modules['impl'] = types.SimpleNamespace(OK=True)\n"
    )
    info = outside / "fake_impl_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-impl-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pytest11]\nfake = fake_impl_plugin\n")
    repo.card(tdd=False)
    repo.tests(impl=IMPORTS_IMPL, tdd=False)
    repo.commit("tests only")
    monkeypatch.setenv("PYTHONPATH", str(outside))
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    result = repo.pytester.run(
        sys.executable, "-m", "cardgate", "gate", "T-001", "--root", str(repo.path)
    )
    assert result.ret == FAIL, _out(result)
    plugins = manifest_of(repo.evidence()[-1])["plugins"]
    assert not [p for p in plugins if "fake" in p["name"]]


def test_pth_files_are_inventoried_and_code_outside_a_distribution_is_flagged(
    tmp_path: Path,
) -> None:
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir()
    (site_dir / "paths.pth").write_text("/somewhere/src\n")
    (site_dir / "evil.pth").write_text("import builtins; builtins.OK = True\n")
    (site_dir / "ok.pth").write_text("import ok_hook\n")
    dist = site_dir / "okdist-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: okdist\nVersion: 1.0\n")
    (dist / "RECORD").write_text("ok.pth,,\nokdist-1.0.dist-info/METADATA,,\n")
    assert hasattr(inventory, "pth_files"), "no .pth inventory"
    found = {p["file"]: p for p in inventory.pth_files([site_dir], tmp_path)}
    assert set(found) == {"paths.pth", "evil.pth", "ok.pth"}
    assert found["paths.pth"]["code"] is False and found["paths.pth"]["paths"] == ["/somewhere/src"]
    assert found["evil.pth"]["code"] is True and found["evil.pth"]["dist"] is None
    assert found["ok.pth"]["dist"] == "okdist==1.0"
    checks = inventory_checks(Inventory(environment={"pth": list(found.values())}))
    failed = [c for c in checks if c.status is Verdict.FAIL]
    assert len(failed) == 1 and "evil.pth" in failed[0].reason


# --- options ------------------------------------------------------------------------------


@pytest.mark.card(CARD, "caller-pytest-arguments-are-limited-to-an-allowlist", RED, GREEN)
@pytest.mark.parametrize(
    "args",
    [
        ("-p", "no:cardgate"),
        ("-o", "cardgate_plugins=x"),
        ("--override-ini=python_functions=nothing",),
        ("-c", "other.ini"),
        ("--rootdir=/tmp",),
        ("--confcutdir=tests",),
        ("--cardgate-timeout=100000",),
        ("--deselect", "tests/test_demo.py::test_one"),
        ("-m", "bench"),
        ("tests/test_demo.py",),
        ("-k", "not test_one"),  # -k only on a dry run
    ],
)
def test_caller_pytest_arguments_outside_the_allowlist_are_refused(
    repo: Repo, args: tuple[str, ...]
) -> None:
    ready(repo, impl="False")
    result = repo.gate("--", *args)
    assert result.ret == USAGE, _out(result)
    assert "not allowed" in _out(result)
    assert not repo.evidence()


@pytest.mark.card(CARD, "caller-pytest-arguments-are-limited-to-an-allowlist", RED, GREEN)
def test_k_narrows_a_dry_run_only(repo: Repo) -> None:
    ready(repo, impl="False")
    result = repo.gate("--dry-run", "--", "-k", "not test_one")
    assert result.ret == HOLD, _out(result)


@pytest.mark.card(CARD, "tests-headers-hold-paths-only", RED, GREEN)
def test_an_option_in_the_tests_header_is_a_card_error(repo: Repo) -> None:
    ready(repo, impl="False")
    card = repo.path / IN_PROGRESS_CARD
    header = "Depends on: none\nTests: tests, --override-ini=python_functions=nothing"
    card.write_text(card.read_text().replace("Depends on: none", header))
    repo.commit("an option in Tests:")
    result = repo.gate()
    assert result.ret == USAGE, _out(result)
    assert "paths only" in _out(result)


def _timeout_card(repo: Repo, body: str) -> None:
    _plain(repo)
    card = repo.path / IN_PROGRESS_CARD
    card.write_text(card.read_text().replace("Depends on: none", "Depends on: none\nTimeout: 1"))
    repo.write("tests/test_slow.py", body)
    repo.commit("Timeout: 1")


@pytest.mark.card(CARD, "the-caller-cannot-raise-the-card-s-timeout", RED, GREEN)
def test_the_caller_cannot_raise_the_card_timeout(repo: Repo) -> None:
    _timeout_card(repo, "def test_nothing():\n    pass\n")
    result = repo.gate("--timeout", "100")
    assert result.ret == USAGE, _out(result)
    assert "Timeout: 1" in _out(result)
    assert repo.gate("--dry-run", "--timeout", "0.5").ret == PASS


@pytest.mark.card(CARD, "durations-are-checked-against-the-timeout-after-the-run", RED, GREEN)
def test_a_test_that_cancels_the_alarm_and_runs_past_the_timeout_fails(repo: Repo) -> None:
    _timeout_card(
        repo,
        "import signal, time\nimport pytest\n\n"
        '@pytest.mark.card("T-001", "child-one")\n'
        "def test_slow():\n"
        "    signal.setitimer(signal.ITIMER_REAL, 0)\n"
        "    time.sleep(2.2)\n",
    )
    result = repo.gate()
    assert result.ret == FAIL, _out(result)
    result.stdout.fnmatch_lines(["*child-one*test_slow*ran 2.* s*Timeout: 1*"])
    assert _items(repo.evidence()[-1])["child-one"] == "fail"


# --- red records ------------------------------------------------------------------------


REPORT_HOOK_CONFTEST = """\
import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    return (yield)
"""


@pytest.mark.card(CARD, "a-red-run-with-a-failed-check-is-not-a-red-record", RED, GREEN)
def test_a_red_run_with_a_failed_check_is_refused_by_the_green_gate(repo: Repo) -> None:
    repo.card()
    repo.tests(impl=IMPORTS_IMPL)
    repo.write("src/impl.py", "OK = False\n")
    repo.write("tests/conftest.py", REPORT_HOOK_CONFTEST)  # undeclared report hook: FAIL check
    repo.commit("red, with an undeclared plugin")
    red = repo.gate("--phase", "red")
    assert red.ret == FAIL, _out(red)
    red.stdout.fnmatch_lines(["*FAIL  plugins*conftest.py*"])
    (repo.path / "tests/conftest.py").unlink()
    repo.write("src/impl.py", "OK = True\n")
    repo.commit("green")
    green = repo.gate()
    assert green.ret == HOLD, _out(green)
    green.stdout.fnmatch_lines(["*no valid red record*a check failed*"])


# --- hardware ------------------------------------------------------------------------------


def _fake_torch(name: str | None) -> types.ModuleType:
    torch = types.ModuleType("torch")
    cuda = types.SimpleNamespace(
        is_available=lambda: name is not None, get_device_name=lambda index=0: name
    )
    torch.cuda = cuda  # type: ignore[attr-defined]
    torch.version = types.SimpleNamespace(cuda="12.4")  # type: ignore[attr-defined]
    return torch


def _driver(tmp_path: Path, model: str | None) -> Path:
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    if model:
        (gpus / "0000:01:00.0").mkdir()
        (gpus / "0000:01:00.0/information").write_text(f"Model: \t\t {model}\nIRQ: 1\n")
    return gpus


@pytest.mark.card(CARD, "the-gpu-key-needs-torch-and-the-driver-to-agree", RED, GREEN)
@pytest.mark.parametrize(
    ("torch_name", "driver_name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", None, "cpu:"),  # a fake torch on a CPU machine
        (None, "NVIDIA H100 80GB HBM3", "cpu:"),  # a driver torch cannot use
        ("NVIDIA H100 80GB HBM3", "NVIDIA A10G", "cpu:"),  # they disagree
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"),
    ],
)
def test_the_gpu_key_needs_torch_and_the_driver_to_agree(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    torch_name: str | None,
    driver_name: str | None,
    key: str,
) -> None:
    monkeypatch.delenv("CARDGATE_GPU", raising=False)
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(torch_name))
    monkeypatch.setattr(hardware, "DRIVER_GPUS", str(_driver(tmp_path, driver_name)))
    assert hardware.hardware_key().startswith(key)


@pytest.mark.card(CARD, "a-forced-gpu-without-a-driver-is-refused", RED, GREEN)
def test_a_forced_gpu_without_a_driver_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hardware, "DRIVER_GPUS", str(_driver(tmp_path, None)))
    monkeypatch.setenv("CARDGATE_GPU", "1")
    assert hasattr(hardware, "forced_gpu_problem"), "CARDGATE_GPU=1 is trusted"
    problem = hardware.forced_gpu_problem()
    assert problem is not None and "CARDGATE_GPU=1" in problem
    monkeypatch.setenv("CARDGATE_GPU", "0")
    assert hardware.forced_gpu_problem() is None


@pytest.mark.card(CARD, "a-forced-gpu-without-a-driver-is-refused", RED, GREEN)
def test_the_gate_refuses_cardgate_gpu_1_without_a_driver(
    repo: Repo, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = _driver(tmp_path_factory.mktemp("driver"), None)
    monkeypatch.setattr(hardware, "DRIVER_GPUS", str(driver))
    ready(repo)
    monkeypatch.setenv("CARDGATE_GPU", "1")
    with pytest.raises(GateUsageError, match="CARDGATE_GPU=1"):
        preflight(GateOptions("T-001", root=repo.path))
    monkeypatch.setenv("CARDGATE_GPU", "0")
    assert preflight(GateOptions("T-001", root=repo.path)).card.id == "T-001"


@pytest.mark.card(CARD, "the-manifest-s-hardware-equals-the-metrics-hardware", RED, GREEN)
def test_the_manifest_hardware_must_equal_the_metrics_hardware() -> None:
    assert hasattr(decide, "hardware_checks"), "nobody compares the two"
    (check,) = decide.hardware_checks("NVIDIA H100 80GB HBM3", "cpu:intel-amx")
    assert check.status is Verdict.FAIL and "cpu:intel-amx" in check.reason
    (same,) = decide.hardware_checks("cpu:intel-amx", "cpu:intel-amx")
    assert same.status is Verdict.PASS
