"""`benchmark.common.CpuMeter`: this process's CPU over a window at the clock's resolution, not
the kernel's 10 ms ticks (a 55 ms benchmark run read 0.00 of a core: the saturation test of
issue 39 failed in CI)."""

from __future__ import annotations

import time

from minisgl.benchmark.common import CpuMeter


def busy(seconds: float) -> float:
    """Spin for `seconds` of this process's CPU; the CPU time spent."""
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass
    return time.process_time() - start


def test_a_few_milliseconds_of_cpu_are_measured():
    for _ in range(5):
        with CpuMeter() as meter:
            spent = busy(0.003)
        assert abs(meter.result["client_cpu_s"] - spent) < 0.001, (meter.result, spent)
        wall = meter.result["wall_s"]
        assert meter.result["client_cpu_pct"] == 100.0 * meter.result["client_cpu_s"] / wall
