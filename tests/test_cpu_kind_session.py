"""`tools/ci/cpu_kind_session.sh` (issue 35): one command for a CPU kind's measurements. Its
card list is every card with a gate keyed by CPU kind; a step it does not know is refused
before anything is installed or run."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "ci" / "cpu_kind_session.sh"


def _assigned(name: str) -> list[str]:
    m = re.search(rf'^{name}="([^"]*)"', SCRIPT.read_text(), re.MULTILINE)
    assert m, name
    return m.group(1).split()


def test_it_gates_every_card_keyed_by_cpu_kind():
    keyed = sorted(
        p.stem for p in (ROOT / "worklog" / "gates").glob("*.yaml")
        if re.search(r'hardware:\s*"cpu:', p.read_text())
    )  # fmt: skip
    assert keyed and _assigned("CARDS") == keyed


def test_every_step_has_its_function():
    text = SCRIPT.read_text()
    steps = _assigned("STEPS")
    assert steps == ["suite", "start", "single", "batched", "gates"]
    assert all(re.search(rf"^run_{s}\(\) {{", text, re.MULTILINE) for s in steps)


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), "start", "bogus"], capture_output=True,
                          text=True, timeout=60, env={"OUT": str(out), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 2
    assert (
        "unknown step 'bogus'" in done.stderr and "suite start single batched gates" in done.stderr
    )
    assert not out.exists()


def test_the_batched_step_leaves_w8a8_out_where_the_cpu_refuses_it():
    """W8A8 refuses a CPU without an int8 matrix unit (the x86-avx2 kind): the batched step asks
    `int8_matrix_unit_missing` and measures the default config alone there, saying why."""
    body = re.search(r"^run_batched\(\) \{\n(.*?)^\}", SCRIPT.read_text(), re.M | re.S)
    assert body, "run_batched"
    text = body.group(1)
    assert "int8_matrix_unit_missing" in text and "configs=default,w8a8" in text
    assert re.search(
        r'\[ -n "\$why" \] && \{ configs=default; echo "w8a8 left out: \$why"; \}', text
    )
    assert '--configs "$configs"' in text
