"""The launcher's ipc dir: a dir left by a killed launcher is removed by the next start."""

from __future__ import annotations

import os
import subprocess
import sys

from minisgl import ipc


def test_stale_ipc_dirs_of_dead_launchers_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = tmp_path / "minisgl-stale"
    stale.mkdir()
    (stale / ipc.PID_FILE).write_text(dead.stdout.strip())
    (stale / "scheduler").write_text("")
    live = tmp_path / "minisgl-live"
    live.mkdir()
    (live / ipc.PID_FILE).write_text(str(os.getppid()))
    other = tmp_path / "unrelated"
    other.mkdir()
    new = ipc.make_ipc_dir(str(tmp_path))
    assert not stale.exists() and live.exists() and other.exists()
    assert (tmp_path / os.path.basename(new) / ipc.PID_FILE).read_text() == str(os.getpid())


def test_fault_step_cpu_burns_cpu_time_not_wall_time(monkeypatch):
    """`MINISGL_FAULT_STEP_CPU_MS`: a slower build whose extra cost is CPU work, as a real
    control-plane regression is (the release trial's slower build, issue 41): on a loaded
    machine a sleep hides in the wait for a core, a spin does not."""
    import time

    from minisgl import ipc

    monkeypatch.setattr(ipc, "FAULT_STEP_DELAY_S", 0.0)
    monkeypatch.setattr(ipc, "FAULT_STEP_CPU_S", 0.02, raising=False)
    t0 = time.thread_time()
    ipc.fault_step_delay()
    assert time.thread_time() - t0 >= 0.02
