"""The root conftest's `suite_check` selection: off by default, on with `--run-suite-check`, and
on for the gate of the card it is bound to (the gate refuses caller options: P1-012's gate lost
its suite check when the allowlist came, and bindings at collection failed its item)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE_CHECK = "tests/test_no_pyo3_runtime.py::test_full_suite_without_extension"


def collected(*options: str) -> list[str]:
    """The node ids pytest collects from the suite-check file with `options` (none: exit 5)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
         "tests/test_no_pyo3_runtime.py", *options],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode in (0, 5), done.stdout[-2000:] + done.stderr[-2000:]
    return [ln for ln in done.stdout.splitlines() if "::" in ln]


@pytest.mark.parametrize(
    "options,kept",
    [((), False), (("--run-suite-check",), True), (("--cardgate-card", "P1-012"), True),
     (("--cardgate-card", "P1-001"), False)],
)  # fmt: skip
def test_suite_check_is_kept_only_when_asked_or_gated(options, kept):
    assert (SUITE_CHECK in collected(*options)) is kept
