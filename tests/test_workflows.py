"""The CI workflows keep their safety and coverage invariants (parsed, not eyeballed).

Fork guard, least-privilege permissions, timeouts, superseded-run cancellation, the GPU
matrix on self-hosted runners, the Python matrix, docs-only skips and caches: a later edit
that drops one of them fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
SAME_REPO = "github.event.pull_request.head.repo.full_name == github.repository"
DOCS_PATHS = {"docs/**", "mkdocs.yml"}


def load(name: str) -> dict[str, Any]:
    data = yaml.safe_load((WORKFLOWS / name).read_text(encoding="utf-8"))
    # YAML 1.1 reads the key `on` as True
    data["on"] = data.pop(True, data.get("on"))
    return data


def all_workflows() -> dict[str, dict[str, Any]]:
    return {p.name: load(p.name) for p in sorted(WORKFLOWS.glob("*.y*ml"))}


def steps_text(job: dict[str, Any]) -> str:
    return "\n".join(json.dumps(step) for step in job.get("steps", []))


def runs_on(job: dict[str, Any]) -> list[str]:
    value = job.get("runs-on")
    return [value] if isinstance(value, str) else list(value or [])


def test_the_workflows_exist():
    assert {"ci.yml", "docs.yml", "gpu.yml"} <= set(all_workflows())


@pytest.mark.parametrize("name", sorted(p.name for p in WORKFLOWS.glob("*.y*ml")))
def test_every_workflow_is_least_privilege_bounded_and_cancellable(name):
    wf = load(name)
    assert "pull_request_target" not in wf["on"], "pull_request_target runs fork code with secrets"
    assert wf.get("permissions") == {"contents": "read"}, "top-level permissions: contents: read"
    concurrency = wf.get("concurrency")
    assert isinstance(concurrency, dict) and concurrency.get("cancel-in-progress") is True
    assert "github.ref" in concurrency["group"]
    for job_name, job in wf["jobs"].items():
        assert isinstance(job.get("timeout-minutes"), int), f"{name}:{job_name} has no timeout"
        assert 0 < job["timeout-minutes"] <= 180
        for scope, level in (job.get("permissions") or {}).items():
            # write access only where a job publishes (Pages), never contents or actions
            assert level in ("read", "none") or scope in {"pages", "id-token"}, (name, job_name)
        for step in job.get("steps", []):
            if str(step.get("uses", "")).startswith("actions/checkout"):
                assert step.get("with", {}).get("persist-credentials") is False, (name, job_name)


@pytest.mark.parametrize("name", ["ci.yml", "gpu.yml"])
def test_docs_only_changes_are_skipped_and_nothing_else(name):
    triggers = load(name)["on"]
    for event in ("push", "pull_request"):
        ignored = triggers[event]["paths-ignore"]
        assert set(ignored) >= DOCS_PATHS
        for path in ignored:
            assert not path.startswith(
                ("packages", "rust", "kanban", "tests", "tools", "noxfile", "*")
            ), path
            assert path != "worklog/**", "evidence and gates are inputs of the card tests"


def test_gpu_jobs_run_on_self_hosted_gpu_runners_never_for_forks():
    wf = load("gpu.yml")
    triggers = wf["on"]
    assert triggers["push"]["branches"] == ["main"]
    assert "labeled" in triggers["pull_request"]["types"]
    assert set(triggers["push"]["paths-ignore"]) >= DOCS_PATHS
    assert set(triggers["pull_request"]["paths-ignore"]) >= DOCS_PATHS
    gpu_jobs = {n: j for n, j in wf["jobs"].items() if "self-hosted" in runs_on(j)}
    assert gpu_jobs
    for name, job in gpu_jobs.items():
        labels = runs_on(job)
        assert labels[:3] == ["self-hosted", "linux", "gpu"], name
        assert "${{ matrix.gpu }}" in labels, "one runner label per GPU kind"
        assert "gpu" in job["strategy"]["matrix"]
        assert job["strategy"].get("fail-fast") is False
        guard = " ".join(str(job.get("if", "")).split())
        assert SAME_REPO in guard, f"{name}: no same-repository guard"
        assert "github.event_name != 'pull_request'" in guard
        assert "contains(github.event.pull_request.labels.*.name, 'gpu')" in guard
        text = steps_text(job)
        assert "nox -s gpu" in text
        uploads = [
            s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact")
        ]
        assert uploads and uploads[0].get("if") == "always()"
        assert "worklog/evidence/" in uploads[0]["with"]["path"]
        assert "setup-uv" in text and "enable-cache" in text
        assert "actions/cache" in text and ".cargo/registry" in text


def test_no_self_hosted_runner_outside_the_guarded_gpu_workflow():
    for name, wf in all_workflows().items():
        for job_name, job in wf["jobs"].items():
            if "self-hosted" in runs_on(job):
                assert name == "gpu.yml" and SAME_REPO in str(job.get("if", "")), (name, job_name)


def test_ci_covers_lint_rust_and_three_pythons():
    wf = load("ci.yml")
    assert set(wf["on"]["push"]["paths-ignore"]) >= DOCS_PATHS
    assert set(wf["on"]["pull_request"]["paths-ignore"]) >= DOCS_PATHS
    jobs = wf["jobs"]
    assert "nox -s lint" in steps_text(jobs["lint"])
    assert "nox -s rust" in steps_text(jobs["rust"])
    assert ".cargo/registry" in steps_text(jobs["rust"])
    tests = jobs["tests"]
    assert tests["strategy"]["matrix"]["python"] == ["3.11", "3.12", "3.13"]
    text = steps_text(tests)
    assert "nox -s tests" in text and "${{ matrix.python }}" in text
    assert "enable-cache" in text


def test_docs_artifact_on_pull_requests_and_pages_from_main_only():
    wf = load("docs.yml")
    build = wf["jobs"]["build"]
    assert "nox -s docs" in steps_text(build)
    by_use = {str(s.get("uses", "")).split("@")[0]: s for s in build["steps"]}
    assert by_use["actions/upload-artifact"]["if"] == "github.event_name == 'pull_request'"
    main_only = "github.event_name == 'push' && github.ref == 'refs/heads/main'"
    assert by_use["actions/upload-pages-artifact"]["if"] == main_only
    deploy = wf["jobs"]["deploy"]
    assert deploy["if"] == main_only
    assert deploy["permissions"] == {"pages": "write", "id-token": "write"}


def test_lint_session_runs_actionlint():
    noxfile = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    lint = noxfile[
        noxfile.index("def lint(") : noxfile.index("\n@nox.session", noxfile.index("def lint("))
    ]
    assert 'session.run("actionlint"' in lint


USES_LINE = re.compile(r"^\s*(?:-\s+)?uses:\s*(?P<ref>\S+)(?P<rest>.*)$")
PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")
TAG_COMMENT = re.compile(r"^\s+# v\d+(\.\d+)*\s*$")


@pytest.mark.parametrize("name", sorted(p.name for p in WORKFLOWS.glob("*.y*ml")))
def test_every_action_is_pinned_by_commit_sha_with_its_tag_in_a_comment(name):
    # YAML drops comments, so the raw lines: `uses: owner/repo@<40 hex> # v1.2.3`
    lines = (WORKFLOWS / name).read_text(encoding="utf-8").splitlines()
    uses = [m for m in map(USES_LINE.match, lines) if m]
    assert uses, name
    for m in uses:
        ref = m["ref"]
        if ref.startswith("./"):
            continue  # a local action is pinned by the checkout itself
        assert PINNED.match(ref), f"{name}: {ref} is not pinned by a full commit SHA"
        assert TAG_COMMENT.match(m["rest"]), f"{name}: {ref} has no '# vX.Y.Z' tag comment"


def test_lint_session_runs_zizmor_offline():
    noxfile = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    lint = noxfile[
        noxfile.index("def lint(") : noxfile.index("\n@nox.session", noxfile.index("def lint("))
    ]
    assert 'session.run("zizmor"' in lint and '"--offline"' in lint
    assert lint.index('session.run("actionlint"') < lint.index('session.run("zizmor"')
