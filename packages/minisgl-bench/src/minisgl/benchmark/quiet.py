"""Whether the machine was quiet while a timed pass ran: the CPU it spent outside the pass.

    before = quiet.sample()
    ...  # the pass: this process and its descendants (a peer's processes are)
    load = quiet.load_between(before, quiet.sample())  # PassLoad(other_cores=..., steal=...)

A pass on a shared 2-core VM can run at half speed because of something else on the machine
(amd-epyc, 2026-12-08: a kind session's seed-offline passes of minisgl bf16 at 211, 103 and 100
tok/s, vLLM's beside them steady), and its tok/s alone cannot say why. Two numbers can, from
Linux's own counters: `other_cores`, the CPU the whole machine was busy (`/proc/stat`) less what
this process and every process below it spent (`/proc/<pid>/stat`), over the pass's wall time
(in cores: 1.0 is one core taken all along); and `steal`, the fraction of the machine's time
the hypervisor gave to other guests. Elsewhere than Linux, `sample()` is None and so is the load.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# a pass above either is reported as not quiet (`cpu_speed`'s summary and its record)
OTHER_CORES_LIMIT = 0.25
STEAL_LIMIT = 0.10
TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)  # a tick's seconds


@dataclass(frozen=True)
class CpuSample:
    """Counters at one moment, in clock ticks: the machine's busy and stolen time, its total
    (idle included), and the CPU of the process tree rooted at `root`."""

    wall_s: float
    busy: int
    steal: int
    total: int
    tree: int
    root: int


@dataclass(frozen=True)
class PassLoad:
    """What else ran during a pass: cores' worth of other work, the stolen fraction."""

    other_cores: float
    steal: float

    @property
    def quiet(self) -> bool:
        return self.other_cores <= OTHER_CORES_LIMIT and self.steal <= STEAL_LIMIT

    def to_dict(self) -> dict[str, float]:
        return {"other_cores": round(self.other_cores, 3), "steal": round(self.steal, 4)}


def noisy(loads: Sequence[Mapping[str, float] | None]) -> list[int]:
    """The indices of the passes whose recorded load (`PassLoad.to_dict`; None: not measured)
    is over the limits."""
    return [i for i, x in enumerate(loads) if x is not None and not PassLoad(**x).quiet]


def parse_cpu_line(line: str) -> tuple[int, int, int]:
    """(busy, steal, total) ticks of `/proc/stat`'s aggregate `cpu` line: busy is user, nice,
    system, irq and softirq (guest time is inside user already); steal apart; total all of
    them with idle and iowait."""
    fields = line.split()
    if not fields or fields[0] != "cpu":
        raise ValueError(f"not the aggregate cpu line of /proc/stat: {line[:40]!r}")
    v = [int(x) for x in fields[1:9]] + [0] * max(0, 9 - len(fields))
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    busy = user + nice + system + irq + softirq
    return busy, steal, busy + idle + iowait + steal


def parse_pid_stat(text: str) -> tuple[int, int]:
    """(parent pid, utime + stime ticks) of one `/proc/<pid>/stat` (its command name may hold
    spaces and parentheses: the fields start after the last ')')."""
    rest = text[text.rindex(")") + 2 :].split()
    return int(rest[1]), int(rest[11]) + int(rest[12])


def tree_ticks(stats: dict[int, tuple[int, int]], root: int) -> int:
    """CPU ticks of `root` and its descendants, from {pid: (parent, ticks)}."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total


def _pid_stats(proc: str) -> dict[int, tuple[int, int]]:
    out: dict[int, tuple[int, int]] = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat")) as f:
                out[int(name)] = parse_pid_stat(f.read())
        except (OSError, ValueError, IndexError):  # gone meanwhile, or unreadable
            continue
    return out


def sample(root: int | None = None, proc: str = "/proc") -> CpuSample | None:
    """The counters now for the tree of `root` (default: this process); None without a
    readable `/proc/stat`."""
    root = os.getpid() if root is None else root
    try:
        with open(os.path.join(proc, "stat")) as f:
            busy, steal, total = parse_cpu_line(f.readline())
        stats = _pid_stats(proc)
    except (OSError, ValueError):
        return None
    return CpuSample(time.monotonic(), busy, steal, total, tree_ticks(stats, root), root)


def load_between(
    before: CpuSample | None, after: CpuSample | None, tick_s: float = TICK_S
) -> PassLoad | None:
    """The load outside the tree between two samples (None where either is missing or no time
    passed). A process of the tree that exited meanwhile takes its ticks with it, which can
    only make `other_cores` larger (never hides load)."""
    if before is None or after is None or after.wall_s <= before.wall_s:
        return None
    total = after.total - before.total
    other_ticks = (after.busy - before.busy) - (after.tree - before.tree)
    other = max(0.0, other_ticks * tick_s / (after.wall_s - before.wall_s))
    steal = (after.steal - before.steal) / total if total > 0 else 0.0
    return PassLoad(other, steal)
