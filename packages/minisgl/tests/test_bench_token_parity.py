"""Token parity tool: equal configurations pass, a real or injected difference is found."""

from __future__ import annotations

import json
import sys

from minisgl.benchmark import token_parity

ARGS = [
    "--max-tokens",
    "6",
    "--token-prompt-count",
    "3",
    "--text-prompt-count",
    "2",
    "--min-input-len",
    "8",
    "--max-input-len",
    "20",
    "--isolation",
    "in-process",
    "--cuda-graph-max-bs",
    "1",
    "--master-port",
    "2380",
]


def run(tmp_path, *extra):
    out = tmp_path / "parity.json"
    rc = token_parity.main([*ARGS, "--out", str(out), *extra])
    return rc, json.loads(out.read_text()) if out.exists() else None


def test_equal_configs_pass_radix_vs_naive(tiny_model_dir, tmp_path):
    rc, data = run(
        tmp_path,
        "--model-path",
        str(tiny_model_dir("llama")),
        "--backend-a",
        "python",
        "--backend-b",
        "python",
        "--cache-a",
        "radix",
        "--cache-b",
        "naive",
    )
    assert rc == 0 and data["parity_passed"] is True
    assert data["sets"]["text_prompts"]["mismatch_count"] == 0
    assert data["sets"]["token_prompts"]["prompts"] == 3
    assert all(len(ids) == 6 for ids in data["outputs"]["a"]["token_prompts"])
    # flags meaningless on CPU are accepted and recorded
    assert data["config"]["cuda_graph_max_bs"] == 1 and data["config"]["master_port"] == 2380
    assert set(data["config"]["ignored_flags"]) == {"cuda_graph_max_bs", "master_port"}
    assert data["sides"]["b"]["cache"] == "naive"


def test_minisgl_vs_hf_passes(tiny_model_dir, tmp_path):
    rc, data = run(
        tmp_path,
        "--model-path",
        str(tiny_model_dir("llama")),
        "--backend-a",
        "python",
        "--backend-b",
        "hf",
    )
    assert rc == 0 and data["parity_passed"] is True


def test_different_weights_are_a_mismatch(tiny_model_dir, tmp_path):
    from minisgl.testing.tiny_models import write_tiny_model

    other = write_tiny_model("llama", tmp_path / "other", seed=1)
    rc, data = run(
        tmp_path,
        "--model-path",
        str(tiny_model_dir("llama")),
        "--model-path-b",
        str(other),
        "--backend-b",
        "python",
    )
    assert rc == 1 and data["parity_passed"] is False
    total = sum(s["mismatch_count"] for s in data["sets"].values())
    assert total > 0
    for s in data["sets"].values():
        for m in s["mismatches"]:
            pos = m["first_diff_pos"]
            assert 0 <= pos < 6 and m["a_token"] != m["b_token"]


def test_injected_mismatch_reports_first_position(tiny_model_dir, tmp_path, monkeypatch, capsys):
    real = token_parity.generate_side

    def fake(side, sets, max_tokens):
        out = real(side, sets, max_tokens)
        if side["cache"] == "naive":  # side B: flip token 4 of token prompt 1
            out["token_prompts"][1][4] += 1
        return out

    monkeypatch.setattr(token_parity, "generate_side", fake)
    rc, data = run(
        tmp_path,
        "--model-path",
        str(tiny_model_dir("llama")),
        "--backend-b",
        "python",
        "--cache-b",
        "naive",
    )
    assert rc == 1 and not data["parity_passed"]
    assert data["sets"]["text_prompts"]["mismatch_count"] == 0
    (m,) = data["sets"]["token_prompts"]["mismatches"]
    assert (m["index"], m["first_diff_pos"]) == (1, 4)
    assert m["b_token"] == m["a_token"] + 1
    assert "first difference at token 4" in capsys.readouterr().out


def test_first_diff():
    assert token_parity.first_diff([1, 2, 3], [1, 2, 3]) is None
    assert token_parity.first_diff([1, 2, 3], [1, 9, 3]) == 1
    assert token_parity.first_diff([1, 2], [1, 2, 3]) == 2


def test_unavailable_rust_backend_is_an_error(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "minisgl_cpu", None)  # import raises ImportError
    rc, data = run(
        tmp_path,
        "--model-path",
        str(tiny_model_dir("llama")),
        "--backend-a",
        "python",
        "--backend-b",
        "rust_hotpath",
    )
    assert rc == 2 and data is None
    err = capsys.readouterr().err
    assert "rust_hotpath" in err and "not importable" in err


def test_missing_model_dir_is_an_error(tmp_path, capsys):
    rc, _ = run(tmp_path, "--model-path", str(tmp_path / "nowhere"), "--backend-b", "python")
    assert rc == 2 and "no config.json" in capsys.readouterr().err
