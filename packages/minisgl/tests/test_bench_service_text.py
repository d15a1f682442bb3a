"""`python -m minisgl.benchmark.service_text`: the Rust service's prompt encoding (`FastBpe`)
against `tokenizers`' encode on a profile's rendered prompts, inside the service binary (written
after `FastBpe` and its CLI op)."""

from __future__ import annotations

import json

import pytest

from minisgl.benchmark import service_text
from minisgl.cpu_service import service_binary


def test_summary_medians_per_token_and_speedup():
    bench = {
        "tokens": 1000,
        "cold_s": {"tokenizers": [0.004, 0.002, 0.003], "fast": [0.001, 0.002, 0.001]},
        "warm_s": {"tokenizers": [0.002], "fast": [0.0005]},
    }
    s = service_text.summarize(bench)
    assert s["cold"]["ms"] == {"tokenizers": pytest.approx(3.0), "fast": pytest.approx(1.0)}
    assert s["cold"]["us_per_token"]["tokenizers"] == pytest.approx(3.0)
    assert s["cold"]["speedup"] == pytest.approx(3.0)
    assert s["warm"]["speedup"] == pytest.approx(4.0)


def test_an_error_reply_is_raised():
    with pytest.raises(RuntimeError, match="bad request"):
        service_text.answer({"error": "bad request: x"})


def test_records_both_encoders_on_the_profile_prompts(tiny_model_dir, tmp_path, capsys):
    try:
        service_binary()
    except FileNotFoundError as e:
        pytest.fail(str(e))
    out = tmp_path / "text.json"
    model = str(tiny_model_dir("llama"))
    rc = service_text.main(["--model-path", model, "--profile", "seed-online", "--repeats", "2",
                            "--out", str(out), "--plot", str(tmp_path / "text.png")])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "service_text" and data["profile"] == "seed-online"
    assert data["identical"] is True and data["fast_encoding"] is True
    assert data["texts"] == 8 and data["tokens"] > 8 * 64  # 8 prompts of 64-256 tokens
    for phase in ("cold", "warm"):
        assert len(data["raw_s"][f"{phase}_s"]["fast"]) == 2
        assert data["summary"][phase]["speedup"] > 0
    assert "speedup" in capsys.readouterr().out
    assert (tmp_path / "text.png").stat().st_size > 1000
