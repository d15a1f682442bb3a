"""Threads a CPU step runs with under other processes' load (`utils/cpu_share.py`, issue 59)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from minisgl.utils import cpu_share
from minisgl.utils.cpu_share import CpuShare, Sample, read_busy


class Feed:
    """Samples and a clock for CpuShare: each `push(wall, busy, own)` is the next reading."""

    def __init__(self) -> None:
        self.now = 0.0
        self.next = Sample(0.0, 0.0, 0.0)

    def push(self, wall: float, busy: float, own: float) -> None:
        self.now, self.next = wall, Sample(wall, busy, own)

    def sample(self) -> Sample:
        return self.next

    def clock(self) -> float:
        return self.now


def _share(threads: int, cores: int, feed: Feed) -> CpuShare:
    return CpuShare(threads, frozenset(range(cores)), 0.2, feed.sample, feed.clock)


@pytest.mark.parametrize(
    ("threads", "cores", "busy", "own", "want"),
    [
        (2, 2, 0.0, 0.0, 2),  # a quiet machine keeps every thread
        (2, 2, 0.5, 0.5, 2),  # this process's own work is not a load
        (2, 2, 2.0 + 0.5, 0.5, 1),  # two cores busy beside it: one thread, never none
        (2, 2, 0.8 + 0.2, 0.2, 1),  # 1.6 cores of others (over the 0.5 s): one thread
        (4, 4, 1.0 * 0.5 + 1.0, 1.0, 3),  # one other core busy of four
        (8, 4, 0.0, 0.0, 4),  # never more threads than cores... configured 8: the cores' 4
    ],
)
def test_threads_are_the_cores_the_others_leave(threads, cores, busy, own, want) -> None:
    feed = Feed()
    share = _share(threads, cores, feed)
    feed.push(0.5, busy, own)
    assert share.threads() == min(want, threads)


def test_a_reading_waits_for_the_interval_and_follows_the_load_back() -> None:
    feed = Feed()
    share = _share(2, 2, feed)
    feed.push(0.5, 1.0, 0.0)  # others: 2 cores
    assert share.threads() == 1
    feed.push(0.6, 1.0, 0.0)  # 0.1 s later: not judged again
    assert share.threads() == 1 and share.others == pytest.approx(2.0)
    feed.push(1.0, 1.0 + 0.5, 0.5)  # the load gone; only this process worked
    assert share.threads() == 2 and share.others == pytest.approx(0.0)


def test_without_readings_the_configured_threads_run() -> None:
    share = CpuShare(2, frozenset({0, 1}), 0.2, lambda: None)
    assert share.threads() == 2
    with pytest.raises(ValueError, match="threads must be >= 1"):
        CpuShare(0)


def test_read_busy_counts_the_watched_cores_and_their_steal(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  900 0 900 9000 0 0 0 0 0 0\n"
        "cpu0 100 1 10 5000 7 2 3 4 0 0\n"  # busy 100 + 1 + 10 + 2 + 3 + 4 = 120
        "cpu1 200 0 20 4000 0 0 0 30 0 0\n"  # 250
        "cpu2 999 0 0 0 0 0 0 0 0 0\n"  # not watched
        "intr 12345\n"
    )
    import os

    tick = os.sysconf("SC_CLK_TCK")
    assert read_busy(frozenset({0, 1}), str(stat)) == pytest.approx(370 / tick)
    assert read_busy(frozenset({5}), str(stat)) is None
    assert read_busy(frozenset({0}), str(tmp_path / "missing")) is None


def test_the_switch_reads_0_or_1(monkeypatch) -> None:
    monkeypatch.setenv(cpu_share.ENV, "0")
    assert not cpu_share.enabled()
    monkeypatch.delenv(cpu_share.ENV)
    assert not cpu_share.enabled()  # off by default (the module's docstring: measured)
    monkeypatch.setenv(cpu_share.ENV, "1")
    assert cpu_share.enabled()
    monkeypatch.setenv(cpu_share.ENV, "maybe")
    with pytest.raises(ValueError, match=cpu_share.ENV):
        cpu_share.enabled()


def test_busy_processes_beside_it_leave_one_thread() -> None:
    """Real /proc/stat: as many spinning processes as watched cores; one thread is left."""
    import os

    cores = sorted(os.sched_getaffinity(0))[:2]
    spin = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin, str(c)]) for c in cores]
    try:
        share = CpuShare(2, frozenset(cores), interval=0.3)
        time.sleep(0.5)
        assert share.threads() == 1, share.others
        assert share.others >= 0.75 * len(cores)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _child_env(script: str, **env: str) -> str:
    import os

    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", script], env={**base, **env}, check=True,
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip()


def test_importing_minisgl_makes_idle_openmp_threads_sleep_before_torch_loads_it() -> None:
    """OpenMP threads that spin between parallel regions (libgomp's default, ACTIVE) ran a
    64-token request in 4.8 s beside other work on 2 cores (68 s with four spinning processes
    more), PASSIVE in 1.0 s (2.6 s): `python -m minisgl.benchmark.contention`, amd-epyc. The
    policy is read once, when torch loads libgomp: `import minisgl` sets it first, and a
    caller's own setting stays."""
    script = ("import os, sys, minisgl; print(os.environ.get('OMP_WAIT_POLICY'), "
              "'torch' in sys.modules)")  # fmt: skip
    assert _child_env(script) == "PASSIVE False"
    assert _child_env(script, OMP_WAIT_POLICY="active") == "active False"


def test_idle_openmp_threads_spin_briefly_before_they_sleep() -> None:
    """PASSIVE alone (a spin count of 0) made every parallel region wake its threads from a
    futex: single-stream decode of the embedded model ran 50.6 tok/s on a quiet intel-amx (2
    threads), 141.8 with 1000 spins first (libgomp: ~10 us) and 143.0 with ACTIVE; beside four
    spinning processes a 14-token request took 0.47-0.52 s with 1000 spins against 0.48-0.75
    PASSIVE (`python -m minisgl.benchmark.contention`, docs/runtime.md). A caller's own
    policy or spin count stays; under ACTIVE no spin count is imposed."""
    script = "import os, minisgl; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    assert _child_env(script) == "PASSIVE 1000"
    assert _child_env(script, GOMP_SPINCOUNT="50") == "PASSIVE 50"
    assert _child_env(script, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE None"
