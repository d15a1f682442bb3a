"""`python -m minisgl.benchmark.cpu_speed` run from a bench test (the cards' speed gates)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_cpu_speed(
    tmp_path: Path, configs: str, profiles: str = "seed-offline,many-short", hf: str = "fp32,bf16"
) -> dict[str, Any]:
    """The `results` of one run (many-short at 128 requests, 2 threads, medians of 2, no
    quality pass), the C decode attention on."""
    out = tmp_path / "cpu_speed.json"
    cmd = [sys.executable, "-m", "minisgl.benchmark.cpu_speed", "--out", str(out),
           "--profiles", profiles, "--configs", configs, "--hf", hf,
           "--set", "many-short.num_requests=128", "--threads", "2", "--repeats", "2",
           "--no-quality"]  # fmt: skip
    env = dict(os.environ, MINISGL_CPU_ATTENTION="native")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3000, env=env, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())["results"]


def run_single_vs_llamacpp(tmp_path: Path, config: str) -> dict[str, Any]:
    """The whole record of one `cpu_speed` run of the single profile: minisgl `config` beside
    llama.cpp on the embedded model's GGUF, 2 threads, medians of 3, no quality pass."""
    out = tmp_path / "cpu_speed.json"
    cmd = [sys.executable, "-m", "minisgl.benchmark.cpu_speed", "--out", str(out),
           "--profiles", "single", "--configs", config, "--hf", "",
           "--threads", "2", "--repeats", "3", "--llamacpp", "--no-quality"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=2000, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())
