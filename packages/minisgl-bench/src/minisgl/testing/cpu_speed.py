"""`python -m minisgl.benchmark.cpu_speed` run from a bench test (the cards' speed gates)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def fast_cpu_speed(
    monkeypatch: Any, model_dir: str, probe: Callable[[str, list[int], int], list[int]]
) -> None:
    """`cpu_speed.main` in this process without its slow parts (`monkeypatch`: pytest's): the
    minisgl arms on `model_dir` (a tiny model), the machine's bounds fixed, and `probe`
    (model path, prompt, n) giving HF fp32's probe tokens that the peers are checked against."""
    from minisgl.benchmark import cpu_speed
    from minisgl.benchmark.offline import make_llm

    monkeypatch.setattr(cpu_speed, "make_llm", lambda _p, prof, kw: make_llm(model_dir, prof, kw))
    monkeypatch.setattr(cpu_speed, "measure_bandwidth", lambda: {"read_gb_s": 10.0})
    bounds = {"fp32_gflop_s": 100.0, "bf16_gflop_s": 100.0}
    monkeypatch.setattr(cpu_speed, "measure_matmul", lambda: bounds)
    monkeypatch.setattr(cpu_speed, "probe_reference", probe)


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
