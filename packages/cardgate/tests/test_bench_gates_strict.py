"""Issue 40, class 7: benchmark gates key on hardware the gate queried itself (recorded), say
which rules did not apply, refuse rules that can never match, duplicate keys and a `Gates:`
header that hides the default file, and a test cannot swallow its timeout."""

from __future__ import annotations

import os
import stat
from fnmatch import fnmatch
from pathlib import Path

import pytest
from cardgate_repo import FAIL, PASS, USAGE, Repo, manifest_of, ready

from cardgate.thresholds import GateFormatError, load_gates

CARD = "P0-007"
RED = "every-class-fails-on-the-gate-before-this-card"
GREEN = "every-class-refused-with-its-reason"

CPU_RULE_AND_ANY_RULE = """\
version: 1
gates:
  - metric: ops
    hardware: cpu
    min: 1000
  - metric: ops
    min: 1
"""


@pytest.mark.card(CARD, "hardware-from-driver-queries-not-path-and-recorded", RED, GREEN)
def test_a_fake_nvidia_smi_on_path_does_not_turn_cpu_rules_off(
    repo: Repo, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path_factory.mktemp("bin") / "nvidia-smi"
    fake.write_text('#!/bin/sh\necho "NVIDIA H100 80GB HBM3, 550.54.15"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CARDGATE_GPU", raising=False)
    ready(repo)  # records ops=100: the CPU rule (>= 1000) fails
    repo.write("worklog/gates/T-001.yaml", CPU_RULE_AND_ANY_RULE)
    repo.commit("gates")
    result = repo.gate()
    manifest = manifest_of(repo.evidence()[-1])
    assert manifest["hardware"] != "NVIDIA H100 80GB HBM3", result.stdout.str()
    assert manifest.get("hardware_source") in {"torch", "driver", "none"}
    real_gpu = Path("/proc/driver/nvidia/gpus").is_dir()
    assert result.ret == FAIL or real_gpu, result.stdout.str()


@pytest.mark.card(
    CARD,
    "rules-that-did-not-apply-are-listed-and-never-matching-patterns-are-lint-errors",
    RED,
    GREEN,
)
def test_rules_for_other_hardware_are_listed_by_name(repo: Repo) -> None:
    ready(repo)
    repo.write(
        "worklog/gates/T-001.yaml",
        'version: 1\ngates:\n  - metric: ops\n    hardware: "*H100*"\n    min: 1.0e9\n'
        "  - metric: ops\n    min: 1\n",
    )
    repo.commit("a GPU rule and a rule for every machine")
    result = repo.gate()
    assert result.ret == PASS, result.stdout.str()
    listed = [line for line in result.outlines if fnmatch(line, "*n/a*ops*min*H100*")]
    assert listed, result.stdout.str()


@pytest.mark.card(
    CARD,
    "rules-that-did-not-apply-are-listed-and-never-matching-patterns-are-lint-errors",
    RED,
    GREEN,
)
@pytest.mark.parametrize("pattern", ["cpu:amd_epyc", "cpu:arm64-sve", "h100"])
def test_a_rule_that_can_never_match_is_a_lint_error(repo: Repo, pattern: str) -> None:
    ready(repo)
    repo.write(
        "worklog/gates/T-001.yaml",
        f'version: 1\ngates:\n  - metric: ops\n    hardware: "{pattern}"\n    min: 1.0e9\n'
        "  - metric: ops\n    min: 1\n",
    )
    repo.commit("a rule for hardware that does not exist")
    result = repo.gate()
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == USAGE, out
    assert pattern in out and "never match" in out


@pytest.mark.card(CARD, "a-gates-header-beside-a-default-gates-file-is-a-lint-error", RED, GREEN)
def test_a_gates_header_cannot_silently_replace_the_default_file(repo: Repo) -> None:
    ready(repo)
    repo.write("worklog/gates/T-001.yaml", "version: 1\ngates:\n  - metric: ops\n    min: 1000\n")
    repo.write("worklog/gates/lenient.yaml", "version: 1\ngates:\n  - metric: ops\n    min: 1\n")
    card = repo.path / "kanban/in-progress/T-001-demo.md"
    header = "Depends on: none\nGates: worklog/gates/lenient.yaml"
    card.write_text(card.read_text().replace("Depends on: none", header))
    repo.commit("a lenient gates file named in the card")
    result = repo.gate()
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == USAGE, out
    assert "worklog/gates/T-001.yaml" in out


@pytest.mark.card(CARD, "duplicate-yaml-keys-are-a-format-error", RED, GREEN)
def test_duplicate_yaml_keys_are_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "gates.yaml"
    path.write_text("version: 1\ngates:\n  - metric: ops\n    min: 1\n    min: 1000\n")
    try:
        load_gates(path)
        message = None
    except GateFormatError as exc:
        message = str(exc)
    assert message is not None and "duplicate key 'min'" in message and "line 5" in message


SWALLOWS = """\
import time
import pytest

@pytest.mark.card("T-001", "child-one")
def test_one():
    for _ in range(2):
        try:
            time.sleep(1.5)
        except {kind}:
            pass
"""


@pytest.mark.card(CARD, "the-timeout-cannot-be-swallowed", RED, GREEN)
@pytest.mark.parametrize("kind", ["Exception", "BaseException"])
def test_a_test_that_catches_its_timeout_still_fails(repo: Repo, kind: str) -> None:
    ready(repo)
    repo.write("tests/test_demo.py", SWALLOWS.format(kind=kind))
    repo.commit("a test that swallows its timeout")
    result = repo.gate("--timeout", "0.5")
    assert result.ret == FAIL, result.stdout.str()
    result.stdout.fnmatch_lines(["*child-one*timeout*"])
