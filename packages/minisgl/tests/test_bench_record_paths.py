"""Benchmark records hold no local absolute path (the seeds' rule; cardgate's privacy lint).

`harness online` recorded the environment's `MINISGL_CPU_SERVICE_BIN` and its own `--out` as
given (`/work/<checkout>/rust/target/...`, `/tmp/run.json`): session 13's baselines needed
`cardgate migrate-paths` by hand. `write_json` now writes what cardgate's redaction makes of
them: the repository root as `.`, the temporary directory as `<tmp>`."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from minisgl.benchmark import common


def test_records_are_written_with_repo_relative_paths(tmp_path, monkeypatch):
    root = Path(__file__).resolve().parents[3]
    assert (root / "noxfile.py").exists()
    monkeypatch.chdir(root)
    binary = str(root / "rust" / "target" / "release" / "minisgl-cpu-service")
    scratch = os.path.join(tempfile.gettempdir(), "run10.json")
    out = tmp_path / "r.json"
    common.write_json(out, {"argv": ["--out", scratch], "backend_env": {"BIN": binary}, "n": 3})
    data = json.loads(out.read_text())
    assert data["backend_env"]["BIN"] == "./rust/target/release/minisgl-cpu-service"
    assert data["argv"] == ["--out", "<tmp>/run10.json"]
    assert data["n"] == 3
    assert str(root) not in out.read_text()
