"""Backend selection, fallback counters and shadow mode of the scheduler CPU backend."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from minisgl.benchmark import shadow_report
from minisgl.core import SamplingParams
from minisgl.scheduler import cpu_backend
from minisgl.scheduler.backend import SchedulerBackend, SchedulerConfig
from minisgl.scheduler.factory import make_scheduler
from minisgl.scheduler.scheduler import Scheduler

KW = dict(num_pages=64, page_size=4, max_seq_len=96, max_running_requests=4,
          max_extend_tokens=24, cache_type="radix", eos_token_ids=[0])  # fmt: skip
needs_ext = pytest.mark.rust_ext  # the root conftest registers rust_hotpath for these


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in (cpu_backend.ENV_BACKEND, cpu_backend.ENV_SHADOW, cpu_backend.ENV_SHADOW_REPORT,
              cpu_backend.ENV_SHADOW_MAX):  # fmt: skip
        monkeypatch.delenv(k, raising=False)
    cpu_backend.reset_stats()


def make(backend: str | None = None) -> SchedulerBackend:
    return make_scheduler(SchedulerConfig(**KW), backend)


def drive(s, n_req: int = 12, seed: int = 0) -> list[tuple]:
    rng = np.random.default_rng(seed)
    stem = [5, 6, 7, 8, 9, 10, 11, 12]
    for i in range(n_req):
        ids = stem[: rng.integers(0, 8)] + rng.integers(1, 30, size=rng.integers(1, 20)).tolist()
        s.add_request(ids, SamplingParams(max_tokens=int(rng.integers(1, 8))))
        if i == 5:
            s.abort(2)
    outs = []
    while s.has_work():
        plan, reqs = s.schedule()
        toks = rng.integers(1, 30, size=len(plan.sample_rows)).tolist()
        outs += [(o.rid, o.token_id, o.finish_reason) for o in s.commit(reqs, plan, toks)]
        s.check_integrity()
    return outs


@pytest.mark.card("P0-004", "python-is-the-default-and-an-unknown-backend-is-an-error")
def test_default_is_python():
    s = make()
    assert type(s) is Scheduler and s.backend == "python"
    drive(s)
    st = cpu_backend.stats()
    assert st["requested"] == "python" and st["served"]["python"]["schedule"] > 0


@pytest.mark.card("P0-004", "python-is-the-default-and-an-unknown-backend-is-an-error")
def test_unknown_backend_is_an_error(monkeypatch):
    monkeypatch.setenv(cpu_backend.ENV_BACKEND, "fortran")
    with pytest.raises(ValueError, match="MINISGL_CPU_BACKEND"):
        make()


@pytest.mark.card(
    "P0-004",
    "minisgl-cpu-backend-rust-hotpath-serves-every-step-from-rust-and-counts-it",
    "rust-scheduler-behind-the-python-scheduler-interface",
)
@needs_ext
def test_env_selects_rust_and_counts(monkeypatch):
    monkeypatch.setenv(cpu_backend.ENV_BACKEND, "rust_hotpath")
    s = make()
    assert s.backend == "rust_hotpath"
    assert drive(s) == drive(make("python"))
    st = cpu_backend.stats()
    assert st["served"]["rust_hotpath"]["schedule"] > 0
    assert st["served"]["rust_hotpath"]["commit"] > 0
    assert st["fallbacks"] == 0


@pytest.mark.card("P0-004", "a-missing-or-failing-extension-falls-back-to-python-and-is-counted")
@needs_ext
def test_missing_extension_falls_back_once(monkeypatch, caplog):
    monkeypatch.setenv(cpu_backend.ENV_BACKEND, "rust_hotpath")
    monkeypatch.setitem(sys.modules, "minisgl_cpu", None)  # import raises ImportError
    a, b = make(), make()
    assert type(a) is Scheduler and type(b) is Scheduler
    drive(a)
    st = cpu_backend.stats()
    assert st["fallbacks"] == 2 and st["fallback_reasons"] == {"import": 2}
    assert st["served"]["python"]["schedule"] > 0
    assert sum("falling back" in r.message for r in caplog.records) <= 1


@pytest.mark.card(
    "P0-005",
    "shadow-runner-compares-rust-and-python-decisions-per-step-with-either-primary",
    "shadow-report-summarizes-a-report-and-a-missing-file-is-an-error-unless-allowed",
)
@needs_ext
@pytest.mark.parametrize("primary", ["python", "rust_hotpath"])
def test_shadow_agrees(monkeypatch, tmp_path, primary):
    report = tmp_path / "shadow.jsonl"
    monkeypatch.setenv(cpu_backend.ENV_BACKEND, primary)
    monkeypatch.setenv(cpu_backend.ENV_SHADOW, "1")
    monkeypatch.setenv(cpu_backend.ENV_SHADOW_REPORT, str(report))
    s = make()
    assert s.backend.startswith(primary + "+shadow:")
    out = drive(s, n_req=20)
    assert out == drive(make("python"), n_req=20)
    st = cpu_backend.stats()
    assert st["shadow"]["decisions"] > 40 and st["shadow"].get("diffs", 0) == 0
    assert not report.exists()
    assert shadow_report.main(["--input", str(report), "--allow-missing"]) == 0
    assert shadow_report.main(["--input", str(report)]) == 2


@pytest.mark.card(
    "P0-005",
    "divergences-written-as-json-lines-with-kind-step-and-both-backends-capped-by-minisgl-cpu-backend-shadow-max-diffs",
    "the-primary-keeps-serving-when-the-shadow-diverges-or-the-primary-raises",
    "shadow-report-summarizes-a-report-and-a-missing-file-is-an-error-unless-allowed",
)
@needs_ext
def test_shadow_reports_divergence(monkeypatch, tmp_path, capsys):
    report = tmp_path / "shadow.jsonl"
    monkeypatch.setenv(cpu_backend.ENV_BACKEND, "rust_hotpath")
    monkeypatch.setenv(cpu_backend.ENV_SHADOW, "1")
    monkeypatch.setenv(cpu_backend.ENV_SHADOW_REPORT, str(report))
    monkeypatch.setenv(cpu_backend.ENV_SHADOW_MAX, "5")
    s = make()
    s.shadow.max_extend_tokens = 5  # make the reference chunk differently
    drive(s, n_req=6)  # the primary (rust) still serves
    lines = [json.loads(x) for x in report.read_text().splitlines()]
    assert len(lines) == 5 and s.diffs > 5
    assert lines[0]["kind"] == "schedule" and lines[0]["primary_backend"] == "rust_hotpath"
    assert shadow_report.main(["--input", str(report), "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert "5 divergences" in text and "schedule" in text


@pytest.mark.card("P0-004", "a-missing-or-failing-extension-falls-back-to-python-and-is-counted")
@pytest.mark.card(
    "P0-005", "the-primary-keeps-serving-when-the-shadow-diverges-or-the-primary-raises"
)
@needs_ext
def test_rust_exception_falls_back_to_python_shadow(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_backend.ENV_BACKEND, "rust_hotpath")
    monkeypatch.setenv(cpu_backend.ENV_SHADOW, "1")
    monkeypatch.setenv(cpu_backend.ENV_SHADOW_REPORT, str(tmp_path / "r.jsonl"))
    s = make()
    s.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=3))
    plan, reqs = s.schedule()
    s.commit(reqs, plan, [9])

    def boom():
        raise RuntimeError("boom")

    s.primary.schedule = boom
    out = []
    while s.has_work():
        plan, reqs = s.schedule()
        out += list(s.commit(reqs, plan, [9] * len(plan.sample_rows)))
    assert s.primary.backend == "python"
    assert [o.finish_reason for o in out] == [None, "length"]
    st = cpu_backend.stats()
    assert st["fallbacks"] == 1 and "runtime.schedule" in st["fallback_reasons"]
    s.check_integrity()


@pytest.mark.card(
    "P0-005",
    "shadow-runner-compares-rust-and-python-decisions-per-step-with-either-primary",
    "0-divergences-generating-the-parity-corpus-and-shared-prefix-prompts-under-shadow",
)
@needs_ext
def test_llm_generation_under_shadow(monkeypatch, tmp_path, tiny_model_dir):
    from minisgl import LLM
    from minisgl.testing.scenarios import random_prompts

    report = tmp_path / "shadow.jsonl"
    monkeypatch.setenv(cpu_backend.ENV_BACKEND, "rust_hotpath")
    monkeypatch.setenv(cpu_backend.ENV_SHADOW, "1")
    monkeypatch.setenv(cpu_backend.ENV_SHADOW_REPORT, str(report))
    llm = LLM(tiny_model_dir("llama"), num_pages=512, page_size=4, max_extend_tokens=32)
    prompts = random_prompts(6, 5, 40, seed=3)
    prompts += [[*p[:10], 7, 8, 9] for p in prompts[:3]]  # shared prefixes
    got = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert all(len(r["token_ids"]) == 6 for r in got)
    st = cpu_backend.stats()
    assert st["shadow"]["decisions"] > 0 and st["shadow"].get("diffs", 0) == 0
    assert not report.exists()


@needs_ext
@pytest.mark.card(
    "P0-005", "0-divergences-generating-the-parity-corpus-and-shared-prefix-prompts-under-shadow"
)
@pytest.mark.parametrize("primary", ["python", "rust_hotpath"])
def test_parity_corpus_under_shadow(monkeypatch, tmp_path, tiny_model_dir, primary):
    from minisgl import LLM
    from minisgl.benchmark import token_parity

    model = tiny_model_dir("llama")
    flags = ["--token-prompt-count", "6", "--min-input-len", "8", "--max-input-len", "48"]
    args = token_parity.build_parser().parse_args([*flags, "--model-path", str(model)])
    sets, _ = token_parity.build_sets(args)  # the P0-002 corpus: text and seeded token prompts
    prompts = [p for ps in sets.values() for p in ps]
    report = tmp_path / "shadow.jsonl"
    monkeypatch.setenv(cpu_backend.ENV_BACKEND, primary)
    monkeypatch.setenv(cpu_backend.ENV_SHADOW, "1")
    monkeypatch.setenv(cpu_backend.ENV_SHADOW_REPORT, str(report))
    llm = LLM(model, num_pages=256, page_size=4, max_extend_tokens=64, max_running_requests=4)
    assert llm.scheduler.backend.startswith(primary + "+shadow:")
    got = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(r["token_ids"]) for r in got] == [8] * len(prompts)
    st = cpu_backend.stats()
    assert st["shadow"]["decisions"] > 2 * len(prompts) and st["shadow"].get("diffs", 0) == 0
    assert st["fallbacks"] == 0
    assert not report.exists()
