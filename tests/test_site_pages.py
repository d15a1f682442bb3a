"""The generated worklog pages show every card, every evidence run and every baseline.

Runs the page generator of the mkdocs site (tools/site/sitegen) directly, without mkdocs; the
built site itself is checked in Chromium by `nox -s docs` (tools/site/tests).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "site"))

from sitegen.pages import generate_site  # noqa: E402

import cardgate.board  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def generated():
    return generate_site(ROOT)


def card_ids() -> list[str]:
    return sorted(
        p.name.split("-", 2)[0] + "-" + p.name.split("-", 2)[1] for p in ROOT.glob("kanban/*/*.md")
    )


def evidence_runs() -> list[Path]:
    return sorted(p.parent for p in ROOT.glob("worklog/evidence/*/*/summary.json"))


def test_every_card_is_on_the_board_and_has_a_page(generated):
    board = generated.files["board.md"]
    ids = card_ids()
    assert len(ids) >= 10
    for card_id in ids:
        assert f'data-card="{card_id}"' in board
        page = generated.files[f"cards/{card_id}.md"]
        assert page.startswith(f"# {card_id}: ")
        assert f"[{card_id}]({card_id}.md)" in generated.files["cards/index.md"]
    # one tile per card, each in the column of its lane folder
    assert board.count('class="kb-card') == len(ids)
    for path in ROOT.glob("kanban/*/*.md"):
        lane = path.parent.name
        card_id = "-".join(path.name.split("-")[:2])
        column = board[board.index(f'data-lane="{lane}"') :]
        column = column[
            : column.index('<div class="kb-column"', 1)
            if '<div class="kb-column"' in column[1:]
            else None
        ]
        assert f'data-card="{card_id}"' in column, (card_id, lane)


def test_every_evidence_run_is_on_its_card_page_with_its_raw_files(generated):
    runs = evidence_runs()
    assert len(runs) >= 9
    index = generated.files["worklog/evidence.md"]
    for run in runs:
        card_id = run.parent.name
        rel = run.relative_to(ROOT).as_posix()
        page = generated.files[f"cards/{card_id}.md"]
        summary = json.loads((run / "summary.json").read_text())
        assert f'id="run-{run.name.lower()}"' in page
        assert f"{run.name}/summary.json" in index
        for f in run.iterdir():
            assert f"{rel}/{f.name}" in generated.files, f
            assert generated.files[f"{rel}/{f.name}"] == f.read_bytes()
            assert f"{run.name}/{f.name})" in page
        for gate in summary["gates"]:
            assert f"`{gate['metric']}`" in page


def test_every_baseline_has_a_table_and_a_plot(generated):
    page = generated.files["worklog/baselines.md"]
    baselines = sorted(ROOT.glob("worklog/baselines/*.json"))
    assert len(baselines) >= 15
    sections = re.split(r"^## ", page, flags=re.M)[1:]
    by_name = {s.splitlines()[0].strip(): s for s in sections}
    assert sorted(by_name) == sorted(p.stem for p in baselines)
    for path in baselines:
        section = by_name[path.stem]
        assert "|---|" in section, f"{path.name}: no table"
        images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", section)
        assert len(images) == 1, f"{path.name}: no plot"
        target = images[0].removeprefix("../")
        assert generated.files[target].startswith(PNG)
        if path.with_suffix(".png").exists():
            assert generated.files[target] == path.with_suffix(".png").read_bytes()


def test_history_has_one_chart_per_metric_and_machine_class(generated):
    page = generated.files["worklog/history.md"]
    charts = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page)
    assert len(charts) == len(set(charts)) >= 10
    for chart in charts:
        assert generated.files[chart.removeprefix("../")].startswith(PNG)
    # every gated metric of every run is charted on its machine class
    for run in evidence_runs():
        for gate in json.loads((run / "summary.json").read_text())["gates"]:
            assert f"#### `{gate['metric']}`" in page
    assert "## cpu" in page
    for name in ("output_tok_s", "speedup_vs_hf_paired.output_tok_s"):
        assert f"#### `{name}`" in page


# --- a small repository of its own: flags, verification, lanes --------------------------------

CARD = """# {id}: {title}
Priority: P0
Status: {lane}
Depends on: {deps}

## Checklist
- [x] first item
- [ ] second item (manual)
"""


def write_card(root: Path, lane: str, card_id: str, deps: str = "none") -> None:
    path = root / "kanban" / lane / f"{card_id}-x.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(CARD.format(id=card_id, title=f"Card {card_id}", lane=lane, deps=deps))


def write_run(root: Path, card_id: str, name: str, outcome: str, gpu: str | None = None) -> Path:
    run = root / "worklog" / "evidence" / card_id / name
    run.mkdir(parents=True)
    manifest = {
        "card": card_id,
        "commit": "ab" * 20,
        "started_utc": "2026-11-20T10:00:00+00:00",
        "hardware": gpu or "cpu",
        "gpu": {"gpu_name": gpu} if gpu else None,
        "cpu_model": "Test CPU",
        "cpu_count": 4,
        "platform": "Linux",
        "python": "3.12",
    }
    summary = {
        "card_id": card_id,
        "outcome": outcome,
        "phase": name.rsplit("-", 1)[-1],
        "commit": "ab" * 20,
        "checks": [],
        "items": [],
        "gates": [
            {
                "metric": "tok_s",
                "check": "min",
                "status": outcome,
                "value": 12.0,
                "threshold": 10.0,
                "margin_pct": 20.0,
                "message": "",
            }
        ],
    }
    (run / "manifest.json").write_text(json.dumps(manifest))
    (run / "summary.json").write_text(json.dumps(summary))
    return run


@pytest.fixture
def small_repo(tmp_path: Path) -> Path:
    write_card(tmp_path, "done", "T-001")
    write_card(tmp_path, "done", "T-002", deps="T-001")
    write_card(tmp_path, "in-progress", "T-003", deps="T-002")
    write_run(tmp_path, "T-002", "20261120T100000Z-abababa-red", "fail")
    write_run(
        tmp_path, "T-002", "20261120T110000Z-abababa-green", "pass", gpu="NVIDIA H100 80GB HBM3"
    )
    (tmp_path / "worklog" / "baselines").mkdir(parents=True)
    (tmp_path / "worklog" / "baselines" / "custom.json").write_text(json.dumps({"x": 1.5}))
    return tmp_path


def rows_without_verification(root):
    """A board JSON from a cardgate that reports no `verified` / `flags` / `last_gate`."""
    board = cardgate.board.load_board(root)
    cards = [
        {"id": c.id, "lane": lane, "items": 2, "bound": 0, "unbound": 1, "manual": 1}
        for lane, lane_cards in board.lanes.items()
        for c in lane_cards
    ]
    return {"cards": cards, "errors": []}


def test_done_cards_are_flagged_unverified_when_cardgate_does_not_say(small_repo, monkeypatch):
    monkeypatch.setattr(cardgate.board, "board_json", rows_without_verification, raising=False)
    gen = generate_site(small_repo)
    board = gen.files["board.md"]
    assert "⚠ 2 done without verified evidence" in board
    t1 = gen.files["cards/T-001.md"]
    assert "Not verified" in t1 and "no evidence record" in t1
    t2 = gen.files["cards/T-002.md"]
    assert "Not verified" in t2 and "no evidence record" not in t2
    # red then green, oldest first, with the GPU named
    assert t2.index("· red · fail") < t2.index("· green · pass")
    assert "GPU: NVIDIA H100 80GB HBM3" in t2
    assert "Not verified" not in gen.files["cards/T-003.md"]
    # the GPU run charts on its own machine class
    assert "## NVIDIA H100 80GB HBM3" in gen.files["worklog/history.md"]
    assert "## custom" in gen.files["worklog/baselines.md"]


def test_cardgate_verification_is_shown_when_cardgate_reports_it(small_repo, monkeypatch):
    def board_json(root):
        rows = []
        for card_id, lane in (("T-001", "done"), ("T-002", "done"), ("T-003", "in-progress")):
            rows.append(
                {
                    "id": card_id,
                    "lane": lane,
                    "items": 2,
                    "bound": 1,
                    "unbound": 0,
                    "manual": 1,
                    "verified": {"T-001": False, "T-002": True}.get(card_id),
                    "flags": ["evidence commit is not an ancestor of HEAD"]
                    if card_id == "T-001"
                    else [],
                    "last_gate": None,
                }
            )
        return {"cards": rows, "errors": []}

    monkeypatch.setattr(cardgate.board, "board_json", board_json, raising=False)
    gen = generate_site(small_repo)
    assert "⚠ 1 done without verified evidence" in gen.files["board.md"]
    assert "evidence commit is not an ancestor of HEAD" in gen.files["cards/T-001.md"]
    assert '!!! success "Verified"' in gen.files["cards/T-002.md"]
    assert "1 bound · 0 unbound · 1 manual" in gen.files["board.md"]


def test_the_site_generators_modules_import_in_no_circle():
    from minisgl.testing.imports import cycles, module_graph

    graph = module_graph([ROOT / "tools" / "site" / "sitegen"], "sitegen")
    assert {"data", "history", "pages"} <= set(graph) and "data" in graph["pages"]
    assert cycles(graph) == []


# --- the CPU kind matrix (issue 59 item 3) -----------------------------------------------------


def _kind_entry(commit: str, utc: str, suite: dict | None = None, **kw) -> dict:
    return {"commit": commit, "utc": utc, "source": "test", "suite": suite, **kw}


def _suite(failed: int = 0, passed: int = 10) -> dict:
    return {"outcome": "failed" if failed else "passed", "passed": passed, "failed": failed,
            "skipped": 0, "errors": 0, "duration_s": 1.0,
            "failed_ids": [f"tests/t.py::t{i}" for i in range(failed)]}  # fmt: skip


def _kind_record(kind: str, *entries: dict) -> dict:
    return {"schema_version": 1, "kind": kind, "entries": list(entries)}


def test_a_kind_is_stale_when_its_last_suite_failed_or_its_green_commit_is_far_behind(tmp_path):
    from sitegen.kinds import MAX_BEHIND, kind_row, load_kinds

    kinds = tmp_path / "worklog" / "kinds"
    kinds.mkdir(parents=True)
    records = {
        "green": _kind_record("green", _kind_entry("a" * 40, "2026-12-01", _suite())),
        "failed": _kind_record(
            "failed",
            _kind_entry("a" * 40, "2026-12-01", _suite()),
            _kind_entry("b" * 40, "2026-12-02", _suite(failed=2)),
            _kind_entry("c" * 40, "2026-12-03", None, ratios={"single.minisgl-default/llamacpp": 1.5}),
        ),
        "never": _kind_record("never", _kind_entry("a" * 40, "2026-12-01", None)),
    }  # fmt: skip
    for name, record in records.items():
        (kinds / f"{name}.json").write_text(json.dumps(record))
    loaded = {r.kind: r for r in load_kinds(tmp_path)}
    assert sorted(loaded) == ["failed", "green", "never"]

    near = kind_row(loaded["green"], lambda commit: 3)
    assert near.last_green is not None and near.behind == 3 and near.stale_reasons == ()
    far = kind_row(loaded["green"], lambda commit: MAX_BEHIND + 1)
    assert far.stale_reasons == (f"last green commit {MAX_BEHIND + 1} commits behind HEAD",)
    failed = kind_row(loaded["failed"], lambda commit: 1)
    # the last suite run is the one at bbbbbbb (the newest entry ran no suite); green is older
    assert failed.last_suite is not None and failed.last_suite.commit == "b" * 40
    assert failed.last_green is not None and failed.last_green.commit == "a" * 40
    assert failed.stale_reasons == ("last suite run failed (2 failed)",)
    never = kind_row(loaded["never"], lambda commit: None)
    assert never.stale_reasons == ("no suite run recorded",)


SINGLE = "single.minisgl-default/llamacpp"


def test_the_kind_matrix_has_a_row_per_kind_with_its_last_green_commit(generated):
    page = generated.files["worklog/kinds.md"]
    kinds = sorted(p.stem for p in ROOT.glob("worklog/kinds/*.json"))
    assert {"intel-amx", "amd-epyc", "x86-avx2"} <= set(kinds)
    rows = {ln.split("|")[1].strip(): ln for ln in page.splitlines() if ln.startswith("| ")}
    for kind in kinds:
        assert f"`{kind}`" in rows, kind
        assert f"worklog/kinds/{kind}.json" in generated.files
        entries = json.loads((ROOT / f"worklog/kinds/{kind}.json").read_text())["entries"]
        # each ratio cell shows the newest entry that has it, read here from the file itself
        # (a kind session adds entries: literals of one day's values broke at 59f3fea)
        single = [e for e in entries if SINGLE in e.get("ratios", {})]
        if single:
            assert f"{single[-1]['ratios'][SINGLE]:.2f}x" in rows[f"`{kind}`"], kind
        for peer in ("/hf-", "/vllm"):  # each peer's newest entry, whichever came last
            batched = [e for e in entries if any(peer in k for k in e.get("ratios", {}))]
            for key, value in (batched[-1]["ratios"] if batched else {}).items():
                if peer in key:
                    assert f"{value:.2f}x" in rows[f"`{kind}`"], (kind, key)
        runs = [e for e in entries if e.get("suite")]
        cells = [c.strip() for c in rows[f"`{kind}`"].split("|")]
        status, last_run = cells[2], cells[3]
        if not runs:
            assert "no suite run recorded" in status and last_run == "not recorded"
            continue
        last = runs[-1]  # the row says the newest suite run, whatever its outcome
        assert last["commit"][:7] in last_run, (kind, last_run)
        if last["suite"]["outcome"] != "passed":
            assert f"{last['suite']['failed']} failed" in last_run and "stale" in status
        if not any(e["suite"]["outcome"] == "passed" for e in runs):
            assert "no green suite run recorded" in status
    assert "1.23x" in rows["`x86-avx2`"]  # single stream against llama.cpp at 734ec2e


def test_the_kind_matrix_of_a_repository_without_records_says_so(small_repo):
    page = generate_site(small_repo).files["worklog/kinds.md"]
    assert "No CPU kind has a record" in page


def test_a_baselines_versions_come_back_from_one_batch_newest_first(tmp_path):
    """`baseline_versions` reads every committed version of a baseline file in one `git cat-file
    --batch` (`_blobs`): each version's data by its commit, newest first, a version that is no
    JSON object left out, the working copy first when it differs; `_blobs` answers None for a
    missing path and for a folder, and keeps its place for the specs after them."""
    import subprocess

    from sitegen.data import Baseline, _blobs, baseline_versions

    def git(*args: str) -> str:
        env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@e", "PATH": "/usr/bin:/bin"}  # fmt: skip
        done = subprocess.run(["git", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, check=True)  # fmt: skip
        return done.stdout.strip()

    git("init", "-q")
    rel = "worklog/baselines/b.json"
    f = tmp_path / rel
    f.parent.mkdir(parents=True)
    shas = []
    for body in ('{"x": 1}', "not json", '{"x": 2, "s": "a\\nb"}'):
        f.write_text(body)
        git("add", rel)
        git("commit", "-qm", body)
        shas.append(git("rev-parse", "HEAD"))
    f.write_text('{"x": 3}')
    got = baseline_versions(
        tmp_path, Baseline(name="b", path=rel, data={"x": 3}, plot=None, notes=None)
    )
    assert [(sha, data) for sha, _, data in got] == [
        ("", {"x": 3}), (shas[2], {"x": 2, "s": "a\nb"}), (shas[0], {"x": 1})]  # fmt: skip
    specs = [f"{shas[0]}:{rel}", f"{shas[0]}:nope.json", f"{shas[0]}:worklog", f"{shas[1]}:{rel}"]
    assert _blobs(tmp_path, specs) == ['{"x": 1}', None, None, "not json"]
