"""`cpu_speed` interleaves its arms: after an untimed round, every round runs each arm once,
alternating direction, so a drift of the machine's speed during a run falls on every arm
alike."""

from __future__ import annotations

from minisgl.benchmark import cpu_speed
from minisgl.benchmark.profiles import get_profile, warmup_workload


def test_timed_rounds_alternate_direction_after_an_untimed_round():
    prof = get_profile("many-short", {"num_requests": "5"})
    calls: list[tuple[str, int, float]] = []

    def arm(name: str) -> cpu_speed.Arm:
        def run(p, items):
            assert p is prof
            calls.append((name, len(items), max(i.arrival_s for i in items)))
            return {"output_tok_s": float(len(calls))}

        return cpu_speed.Arm(name, run)

    passes = cpu_speed.measure_interleaved([arm("a"), arm("b"), arm("c")], prof, repeats=3)
    warm = len(warmup_workload(prof, 49152))
    assert calls == [("a", warm, 0.0), ("b", warm, 0.0), ("c", warm, 0.0)] + [
        (n, 5, 0.0) for n in ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    ]
    # the untimed first pass apart; each arm's timed passes in the order they ran (the call
    # index is the fake metric)
    assert {k: m["output_tok_s"] for k, m in passes.untimed.items()} == {
        "a": 4.0,
        "b": 5.0,
        "c": 6.0,
    }
    assert {k: [m["output_tok_s"] for m in v] for k, v in passes.timed.items()} == {
        "a": [9.0, 10.0, 15.0],
        "b": [8.0, 11.0, 14.0],
        "c": [7.0, 12.0, 13.0],
    }


def test_every_arm_runs_with_the_allocator_the_record_names(monkeypatch):
    import minisgl.utils.malloc as malloc

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(malloc, "keep_freed_memory", lambda: True)
    assert cpu_speed.malloc_of_arms() == {"all_arms": "trim threshold 2 GB, mmap threshold 32 MB"}
    monkeypatch.setattr(malloc, "keep_freed_memory", lambda: False)
    assert cpu_speed.malloc_of_arms() == {"all_arms": "glibc defaults"}
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1")
    assert cpu_speed.malloc_of_arms() == {
        "all_arms": "GLIBC_TUNABLES=glibc.malloc.trim_threshold=1"
    }
