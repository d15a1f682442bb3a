"""A CPU engine keeps freed heap memory for reuse (minisgl.utils.malloc). Its effect is measured,
not asserted: many-short's minor page faults a run 190k -> 3k (bf16 compiled, 2 threads)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from minisgl import LLM
from minisgl.testing.tiny_models import write_tiny_model


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("setting,applied", [("1", True), (None, True), ("0", False)])
def test_the_thresholds_are_set_unless_turned_off(setting, applied):
    env = {k: v for k, v in os.environ.items() if k != "MINISGL_MALLOC_TUNING"}
    if setting is not None:
        env["MINISGL_MALLOC_TUNING"] = setting
    code = "from minisgl.utils.malloc import keep_freed_memory as k; print(k(), k())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(applied)] * 2


def test_a_cpu_engine_tunes_malloc_at_start(tmp_path, monkeypatch):
    import minisgl.engine.engine as engine

    calls = []
    monkeypatch.setattr(engine, "keep_freed_memory", lambda: calls.append(1) or True)
    LLM(write_tiny_model("llama", tmp_path / "m", seed=0), num_pages=256)
    assert calls == [1]
