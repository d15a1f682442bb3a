"""`benchmark.quiet`: the CPU a timed pass did not spend itself, so that a pass slowed by other
work on the machine is named in `cpu_speed`'s record and summary instead of moving its median
unseen. The counters' arithmetic on fixed `/proc` text, a process tree's CPU on this machine,
and `measure_interleaved` / `summarize` flagging a pass beside a spinning process that is not
the run's (a detached one, as another user's job would be)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minisgl.benchmark import cpu_speed, quiet
from minisgl.benchmark.profiles import PROFILES

LINUX = Path("/proc/stat").exists()
needs_proc = pytest.mark.skipif(not LINUX, reason="reads Linux's /proc")


def test_the_cpu_line_splits_busy_steal_and_total():
    busy, steal, total = quiet.parse_cpu_line("cpu  100 5 20 1000 7 3 2 40 11 0\n")
    assert (busy, steal, total) == (100 + 5 + 20 + 3 + 2, 40, 130 + 1000 + 7 + 40)
    with pytest.raises(ValueError, match="aggregate"):
        quiet.parse_cpu_line("cpu0 1 2 3 4 5 6 7 8")


def test_a_pid_stat_with_spaces_and_parentheses_in_its_name_parses():
    text = "4242 (tok (worker) 1) S 17 4242 4242 0 -1 4194304 100 0 0 0 250 31 0 0 20 0 3 0"
    assert quiet.parse_pid_stat(text) == (17, 281)


def test_the_tree_holds_the_root_and_every_descendant_only():
    stats = {1: (0, 1000), 10: (1, 5), 11: (10, 7), 12: (11, 11), 20: (1, 500), 21: (20, 3)}
    assert quiet.tree_ticks(stats, 10) == 5 + 7 + 11
    assert quiet.tree_ticks(stats, 12) == 11
    assert quiet.tree_ticks(stats, 99) == 0


def test_the_load_is_the_machine_busy_less_the_tree_over_the_wall_time():
    a = quiet.CpuSample(wall_s=10.0, busy=1000, steal=0, total=5000, tree=300, root=1)
    # 2 s: the machine busy 300 ticks (3 s at 100 a second), the tree 100 of them, 20 stolen
    b = quiet.CpuSample(wall_s=12.0, busy=1300, steal=20, total=5400, tree=400, root=1)
    load = quiet.load_between(a, b, tick_s=0.01)
    assert load == quiet.PassLoad(other_cores=pytest.approx(1.0), steal=pytest.approx(0.05))
    assert quiet.PassLoad(0.0, 0.11).quiet is False  # a tenth of the time stolen is too much
    assert not load.quiet
    calm = quiet.load_between(a, quiet.CpuSample(12.0, 1110, 0, 5400, 400, 1), tick_s=0.01)
    assert calm.other_cores == pytest.approx(0.05) and calm.quiet
    # the tree spent more than the machine counted (a child's ticks came and went): never < 0
    assert quiet.load_between(a, quiet.CpuSample(12.0, 1000, 0, 5400, 900, 1)).other_cores == 0
    assert quiet.load_between(None, b) is None and quiet.load_between(b, a) is None


@needs_proc
def test_a_descendants_cpu_counts_as_the_trees_own():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\n"
                              "while time.time() - t < 3: pass"])  # fmt: skip
    try:
        before = quiet.sample()
        time.sleep(1.0)
        after = quiet.sample()
    finally:
        child.kill()
        child.wait()
    assert before is not None and after is not None
    spent = (after.tree - before.tree) * quiet.TICK_S
    assert spent >= 0.5, f"the tree spent {spent:.2f} s of CPU in 1 s beside a spinning child"


def _detached_spinner() -> int:
    """A process spinning on one core whose parent has exited: not in the test's tree."""
    done = subprocess.run(
        ["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    return int(done.stdout.strip())


@needs_proc
def test_a_pass_beside_a_foreign_spinner_is_named_not_quiet(monkeypatch, capsys):
    prof = PROFILES["seed-offline"]
    monkeypatch.setattr(cpu_speed, "build_workload", lambda _p, _v: [])
    monkeypatch.setattr(cpu_speed, "warmup_workload", lambda _p, _v: [])
    spin = {"on": False}

    def run(_prof, _items):
        if spin["on"]:
            time.sleep(1.0)  # the pass waits; the spinner takes a core meanwhile
        return {"output_tok_s": 1.0, "input_tokens": 1, "output_tokens": 1}

    arm = cpu_speed.Arm("minisgl-x", run)
    pid = None
    try:
        spin["on"] = True
        pid = _detached_spinner()
        assert quiet.sample() is not None and pid not in _tree_pids()
        passes = cpu_speed.measure_interleaved([arm], prof, 1)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    load = passes.timed["minisgl-x"][0]["machine_load"]
    assert load["other_cores"] >= 0.5, load
    record = {"results": {}}
    cpu_speed._add_result(record, prof.name, "minisgl-x", passes.timed["minisgl-x"])
    assert "not quiet: repeat 0" in capsys.readouterr().out
    assert record["results"][prof.name]["minisgl-x"]["machine_load_per_repeat"] == [load]
    noisy = cpu_speed.noisy_passes(record["results"])
    assert noisy == [{"profile": prof.name, "arm": "minisgl-x", "repeat": 0, **load}]


def _tree_pids() -> set[int]:
    stats = quiet._pid_stats("/proc")
    mine, grew = {os.getpid()}, True
    while grew:
        more = {p for p, (parent, _) in stats.items() if parent in mine} - mine
        grew = bool(more)
        mine |= more
    return mine


def test_the_noisy_passes_are_those_over_either_limit():
    """A pass over the cores' limit or the stolen fraction's is named; an unmeasured one
    (None) and one at the limits are not."""
    at_limits = {"other_cores": quiet.OTHER_CORES_LIMIT, "steal": quiet.STEAL_LIMIT}
    loads = [
        at_limits,
        None,
        {"other_cores": quiet.OTHER_CORES_LIMIT + 0.01, "steal": 0.0},
        {"other_cores": 0.0, "steal": quiet.STEAL_LIMIT + 0.01},
    ]
    assert quiet.noisy(loads) == [2, 3]
