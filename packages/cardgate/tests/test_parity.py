from __future__ import annotations

import json
from pathlib import Path

import pytest

from cardgate.parity import assert_parity_json, check_parity_json


@pytest.mark.card("P0-000", "parity-json-evidence-checked")
def test_parity_json(tmp_path: Path) -> None:
    def write(data: object) -> Path:
        path = tmp_path / "parity.json"
        path.write_text(json.dumps(data))
        return path

    assert check_parity_json(write({"parity_passed": True, "mismatches": 0})).passed
    assert check_parity_json(write({"parity_passed": True, "divergences": []})).passed
    failed = check_parity_json(write({"parity_passed": True, "mismatches": 2}))
    assert not failed.passed and failed.mismatches == 2
    assert not check_parity_json(write({"parity_passed": False, "mismatches": 0})).passed
    assert not check_parity_json(write({"parity_passed": True})).passed
    assert not check_parity_json(tmp_path / "missing.json").passed
    with pytest.raises(AssertionError, match="mismatches = 1"):
        assert_parity_json(write({"parity_passed": True, "mismatches": [{"i": 3}]}))


@pytest.mark.card("P0-000", "parity-json-evidence-checked")
def test_every_mismatch_field_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "parity.json"
    path.write_text(json.dumps({"parity_passed": True, "mismatches": 0, "divergences": [{"i": 1}]}))
    result = check_parity_json(path)
    assert not result.passed and result.mismatches == 1
    assert result.reasons == ["divergences = 1, expected 0"]
    path.write_text(json.dumps({"parity_passed": True, "mismatches": 0.0, "num_mismatches": 0}))
    assert check_parity_json(path).passed
    path.write_text(json.dumps({"parity_passed": True, "mismatches": 0.5}))
    assert not check_parity_json(path).passed
