"""Threads for the next CPU step, from what the other processes leave of this process's cores.

A step's parallel loops (torch's OpenMP regions and the C kernels, which read
`torch.get_num_threads()` at each call) end at a barrier: with 2 threads on 2 cores that other
processes also want, every region waits for the thread the kernel descheduled, and a 14-token
request took 8-40x its quiet time beside four busy processes (intel-amx, issue 59) where one
thread, which waits for nobody, took ~6x. So before each step the engine asks `CpuShare` how
many threads to run: the cores of this process's affinity minus what the others used over the
last interval (`/proc/stat`'s busy time on those cores less this process's own CPU time),
rounded, between 1 and the configured threads, judged again every `interval` seconds. A quiet
machine keeps every thread.

Off by default: `MINISGL_CPU_THREADS_ADAPT=1` turns it on (the A/B switch of `python -m
minisgl.benchmark.contention`). Measured on the amd-epyc kind (2 cores, one 14-token request
beside four spinning processes, other work on the machine too, medians of 3): fixed 2 threads
0.60 s (4.3x its 0.14 s alone), adapted (1 thread) 0.75 s (5.9x): there 2 threads lose less at
the barriers than one thread's half of the cores costs, unlike the intel-amx report (8-40x with
2 threads, ~6x with 1). That was before `import minisgl` gave OpenMP a short spin; since, it
measured faster than fixed threads beside the load on both kinds (amd-epyc 0.23-0.27 s against
0.26-0.39, intel-amx 0.42 against 0.45; docs/runtime.md), in the contention benchmark only: it
stays off until the batched and server benchmarks are measured with it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

ENV = "MINISGL_CPU_THREADS_ADAPT"


@dataclass(frozen=True)
class Sample:
    """One reading: wall seconds, the busy seconds of the watched cores (all processes), and
    this process's CPU seconds (all its threads)."""

    wall: float
    busy: float
    own: float


def read_busy(cores: frozenset[int], path: str = "/proc/stat") -> float | None:
    """Busy seconds since boot of the CPUs in `cores` (user, nice, system, irq, softirq and
    steal ticks: steal is time another guest ran on this CPU), None where unreadable."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        with open(path, encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = 0
    seen = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
            continue
        if int(name[3:]) not in cores:
            continue
        v = [int(x) for x in rest.split()]
        if len(v) < 8:
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
        busy += user + nice + system + irq + softirq + steal
        seen += 1
    return busy / tick if seen else None


def enabled() -> bool:
    """Whether `MINISGL_CPU_THREADS_ADAPT` turns the adaptation on (default: off)."""
    got = os.environ.get(ENV, "0").strip().lower()
    if got not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{ENV} must be 0 or 1, got {got!r}")
    return got in ("1", "true", "on")


class CpuShare:
    """`threads()`: the threads the next step runs with (see the module's docstring)."""

    def __init__(
        self,
        threads: int,
        cores: frozenset[int] | None = None,
        interval: float = 0.2,
        sample: Callable[[], Sample | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`sample` and `clock` (the wall time `Sample.wall` reads) are the tests' seams."""
        if threads < 1:
            raise ValueError(f"CpuShare: threads must be >= 1, got {threads}")
        self.max_threads = threads
        self.cores = cores if cores is not None else frozenset(os.sched_getaffinity(0))
        self.interval = interval
        self._clock = clock
        self._sample = sample or self._read
        self._last = self._sample()
        self._threads = threads
        self.others = 0.0  # cores the other processes used over the last interval

    def _read(self) -> Sample | None:
        busy = read_busy(self.cores)
        if busy is None:
            return None
        return Sample(self._clock(), busy, time.process_time())

    def threads(self) -> int:
        """The threads for the next step, re-judged once `interval` seconds have passed since
        the last judgement (a reading of /proc/stat costs ~20-40 us, the clock ~0.1)."""
        last = self._last
        if last is None:  # no /proc/stat here: as configured
            return self.max_threads
        if self._clock() - last.wall < self.interval:
            return self._threads
        now = self._sample()
        if now is None or now.wall <= last.wall:
            return self._threads
        span = now.wall - last.wall
        self.others = max(0.0, ((now.busy - last.busy) - (now.own - last.own)) / span)
        self._last = now
        free = len(self.cores) - self.others
        self._threads = max(1, min(self.max_threads, int(free + 0.5)))
        return self._threads

    def apply(self) -> int:
        """Set torch's threads (which the C kernels read at each call too) for the next step."""
        import torch

        n = self.threads()
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        return n


def for_engine(device_type: str) -> CpuShare | None:
    """The share a CPU engine adapts its threads by: None on another device, with one thread,
    or unless `MINISGL_CPU_THREADS_ADAPT=1`."""
    import torch

    threads = torch.get_num_threads()
    if device_type != "cpu" or threads < 2 or not enabled():
        return None
    return CpuShare(threads)
