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
    assert steps == ["suite", "start", "single", "batched", "vllm", "gates", "matrix"]
    assert all(re.search(rf"^run_{s}\(\) {{", text, re.MULTILINE) for s in steps)


def test_the_matrix_step_runs_last_and_records_what_the_steps_left():
    """Issue 59 item 3: the kind's record in worklog/kinds/ is written after the other steps,
    even when some failed (each step's exit code goes into it), with the suite's log only where
    the suite ran in this session and the day's baseline records of this kind."""
    text = SCRIPT.read_text()
    assert _assigned("STEPS")[-1] == "matrix"
    body = re.search(r"^run_matrix\(\) \{\n(.*?)^\}", text, re.M | re.S)
    assert body, "run_matrix"
    call = body.group(1)
    assert "-m minisgl.benchmark.kind_matrix record" in call
    assert '--kind "$KIND"' in call and "worklog/kinds" in call
    assert '"$BASE"/*-"$KIND"-"$DAY".json' in call and "--steps" in call
    assert '"$OUT/suite.log"' in call
    # the steps' exit codes are kept for it; a failed step does not stop the loop
    assert re.search(r'rcs\+=\("\$name=\$rc"\)', text)


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), "start", "bogus"], capture_output=True,
                          text=True, timeout=60, env={"OUT": str(out), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 2
    assert (
        "unknown step 'bogus'" in done.stderr
        and "suite start single batched vllm gates matrix" in done.stderr
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


def test_the_vllm_step_measures_the_batched_workload_against_vllm():
    """Issue 59's goal: seed-offline and many-short (128) against vLLM's CPU build, the default
    config and bf16 (equal precision) beside it, in one run (`nox -s vllm`: its own
    virtualenv), recorded with the kind's other records of the day for the matrix."""
    body = re.search(r"^run_vllm\(\) \{\n(.*?)^\}", SCRIPT.read_text(), re.M | re.S)
    assert body, "run_vllm"
    text = body.group(1)
    assert "python3 -m nox -s vllm --" in text and "--vllm" in text
    assert "--profiles seed-offline,many-short" in text and "many-short.num_requests=128" in text
    assert "default,bf16" in text and "--threads 2" in text and "--repeats 3" in text
    assert '--out "$BASE/cpu-speed-smollm2-vllm-$KIND-$DAY.json"' in text
