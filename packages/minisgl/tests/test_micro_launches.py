"""`python -m minisgl.benchmark.micro --launches`: the table and JSON of launches a decode layer
(the counting itself: `test_fused_decode_layer.py::test_decode_layer_launch_budget`)."""

from __future__ import annotations

import json

import pytest

from minisgl.benchmark import micro
from minisgl.testing import launches


def fake_counts(per_layer: dict[tuple[str, bool], int]):
    def count(arch: str, fused: bool, workdir) -> launches.LayerLaunches:
        n = per_layer[(arch, fused)]
        return launches.LayerLaunches(arch, fused, n, {"aten.mm": n}, 2 * n + 3)

    return count


@pytest.mark.parametrize("over", [False, True])
def test_every_architecture_with_fused_torch_ops_and_budget(tmp_path, monkeypatch, over):
    counts = {(a, f): (11 if f else 31) for a in launches.LAYER_BUDGET for f in (True, False)}
    if over:
        counts[("qwen3", True)] = 15
    monkeypatch.setattr(launches, "decode_layer_launches", fake_counts(counts))
    out = tmp_path / "launches.json"
    assert micro.main(["--launches", "--out", str(out)]) == (1 if over else 0)
    rows = {r["arch"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(rows) == sorted(launches.LAYER_BUDGET)
    assert rows["llama"] == {"arch": "llama", "fused": 11, "torch_ops": 31, "budget": 12,
                             "within_budget": True, "fused_by_kernel": {"aten.mm": 11}}  # fmt: skip
    assert rows["qwen3"]["within_budget"] is not over and rows["qwen3"]["budget"] == 14
