"""Token parity evidence (P0-002, P0-004): the deterministic corpus and the token parity
harness (`python -m minisgl.benchmark.token_parity`, run in-process on a tiny model), its
report checked with `cardgate.parity`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minisgl.benchmark import token_parity

SMALL = ["--max-tokens", "8", "--token-prompt-count", "4", "--text-prompt-count", "4",
         "--min-input-len", "8", "--max-input-len", "40", "--isolation", "in-process",
         "--num-pages", "1024"]  # fmt: skip


def run_parity(tmp_path: Path, model: Path, *extra: str) -> tuple[int, dict, Path]:
    out = tmp_path / "parity.json"
    rc = token_parity.main([*SMALL, "--model-path", str(model), "--out", str(out), *extra])
    return rc, json.loads(out.read_text()), out


def check_report(parity, data: dict, path: Path, metric_name: str) -> None:
    """`parity(path)` on the report itself: its top-level `mismatches` is the per-set sum."""
    total = sum(s["mismatch_count"] for s in data["sets"].values())
    assert total == sum(len(s["mismatches"]) for s in data["sets"].values())
    assert data["mismatches"] == total
    assert data["parity_passed"] is (total == 0)
    result = parity(path, metric_name)
    assert result.mismatches == 0


@pytest.mark.card(
    "P0-002", "corpus-of-fixed-text-prompts-and-seeded-token-prompts-is-deterministic"
)
def test_corpus_is_deterministic():
    a = token_parity.token_prompts(6, 8, 40, vocab=512, seed=0)
    assert a == token_parity.token_prompts(6, 8, 40, vocab=512, seed=0)
    assert a != token_parity.token_prompts(6, 8, 40, vocab=512, seed=1)
    assert all(8 <= len(p) <= 40 and all(0 < t < 512 for t in p) for p in a)
    texts = token_parity.TEXT_PROMPTS
    assert len(texts) >= 4 and len(set(texts)) == len(texts)


@pytest.mark.card(
    "P0-002", "harness-reports-the-first-differing-token-and-length-of-every-mismatching-prompt"
)
def test_compare_reports_first_difference():
    a = {"text_prompts": [[1, 2, 3], [4, 5, 6]], "token_prompts": [[7, 8], [9, 9, 9]]}
    b = {"text_prompts": [[1, 2, 3], [4, 0, 6]], "token_prompts": [[7, 8], [9, 9]]}
    sets = token_parity.compare(a, b)
    assert sets["text_prompts"]["mismatch_count"] == 1
    (m,) = sets["text_prompts"]["mismatches"]
    assert (m["index"], m["first_diff_pos"], m["a_token"], m["b_token"]) == (1, 1, 5, 0)
    (m,) = sets["token_prompts"]["mismatches"]  # an early stop: a length difference
    assert (m["index"], m["first_diff_pos"], m["len_a"], m["len_b"]) == (1, 2, 3, 2)
    assert m["a_token"] == 9 and m["b_token"] is None
    assert token_parity.compare(a, a)["token_prompts"]["mismatch_count"] == 0


@pytest.mark.card(
    "P0-002",
    "parity-report-json-with-parity-passed-and-mismatch-counts-checked-by-cardgate",
    "python-reference-with-radix-and-naive-caches-has-0-mismatches-on-the-corpus",
)
def test_python_radix_vs_naive_parity(tiny_model_dir, tmp_path, parity):
    rc, data, path = run_parity(tmp_path, tiny_model_dir("llama"), "--backend-a", "python",
                                "--backend-b", "python", "--cache-b", "naive", "--page-size", "4")  # fmt: skip
    assert rc == 0
    assert data["sides"]["a"]["cache"] == "radix" and data["sides"]["b"]["cache"] == "naive"
    assert {s["prompts"] for s in data["sets"].values()} == {4}
    assert all(len(ids) == 8 for ids in data["outputs"]["a"]["token_prompts"])
    check_report(parity, data, path, "parity_mismatches_python_radix_vs_naive")


@pytest.mark.rust_ext
@pytest.mark.card("P0-004", "token-parity-report-python-vs-rust-hotpath-with-0-mismatches")
@pytest.mark.parametrize("page_size", ["1", "4"])
def test_python_vs_rust_token_parity(tiny_model_dir, tmp_path, parity, page_size):
    rc, data, path = run_parity(tmp_path, tiny_model_dir("llama"), "--backend-a", "python",
                                "--backend-b", "rust_hotpath", "--page-size", page_size)  # fmt: skip
    assert rc == 0
    assert data["sides"]["a"]["active_backend"] == "python"
    assert data["sides"]["b"]["active_backend"] == "rust_hotpath"
    check_report(parity, data, path, f"parity_mismatches_python_vs_rust_ps{page_size}")
