"""`python -m minisgl.benchmark.structured_ab`: the arms' params, one small run end to end on a
tiny model (every arm decodes the same tokens, the JSON carries medians and ratios)."""

from __future__ import annotations

import json

import pytest

from minisgl.benchmark import structured_ab
from minisgl.testing.tiny_models import write_tiny_model


def test_arms_constrain_none_all_or_every_other():
    lengths = [3, 4, 5, 6]
    for arm, expect in (("free", [False] * 4), ("constrained", [True] * 4),
                        ("mixed", [True, False, True, False])):  # fmt: skip
        params = structured_ab.arm_params(arm, lengths)
        assert [p.response_format is not None for p in params] == expect
        assert [p.max_tokens for p in params] == lengths
        assert all(p.temperature == 0.0 for p in params)
        # the free rows ignore EOS; a constrained one cannot (its grammar decides the end)
        assert all(p.ignore_eos != c for p, c in zip(params, expect, strict=True))


@pytest.mark.slow
def test_a_run_on_a_tiny_model(tmp_path):
    model = write_tiny_model("llama", tmp_path / "m", seed=0)
    out = tmp_path / "s.json"
    code = structured_ab.main(["--model-path", str(model), "--profile", "many-short",
                               "--requests", "6", "--repeats", "1", "--set", "dtype=float32",
                               "--out", str(out)])  # fmt: skip
    record = json.loads(out.read_text())
    assert code == 0, record["median"]
    tokens = {arm: m["output_tokens"] for arm, m in record["median"].items()}
    assert len(set(tokens.values())) == 1 and tokens["free"] == 6 * 16, tokens
    assert all(m["errors"] == 0 for m in record["median"].values())
    ratios = record["ratios"]
    free = record["median"]["free"]["wall_s"]
    assert ratios["constrained_vs_free_wall"] == pytest.approx(
        record["median"]["constrained"]["wall_s"] / free
    )
    assert set(record["repeats"]) == {"free", "constrained", "mixed"}
