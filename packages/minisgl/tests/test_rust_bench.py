"""Benchmark evidence for the Rust CPU core: a small run of `minisgl.benchmark.micro`.

Both backends run side by side in one process (the micro benchmark's own functions, on a
smaller workload: 3,000 shared-prefix sequences instead of 10,000, fewer decode steps), and
every median is recorded through cardgate's `metric` fixture. The thresholds live in
`worklog/gates/P0-003.yaml` (radix, admission) and `worklog/gates/P0-004.yaml` (decode step);
they are relative (Rust >= k x Python, measured in the same run), with k set well below what
`worklog/baselines/micro-cpu.md` shows, because this 2-core machine is shared and noisy.
"""

from __future__ import annotations

import pytest

from minisgl.benchmark.micro import bench_admission, bench_decode, bench_radix, make_workload

NUM_SEQS = 3000
RADIX_REPEATS = 5  # medians of 5: one preempted repeat does not move the result

pytestmark = [pytest.mark.bench, pytest.mark.rust_ext]


@pytest.fixture(scope="module")
def seqs():
    return make_workload(NUM_SEQS)


@pytest.mark.card(
    "P0-003",
    "batched-radix-insert-and-match-at-least-5x-the-python-reference",
    "per-call-radix-insert-at-least-2x-the-python-reference",
    "radix-eviction-at-least-3x-faster-than-the-python-reference",
)
@pytest.mark.parametrize("page_size", [1, 16])
def test_radix_micro(seqs, page_size, metric):
    rows = {r["workload"]: r for r in bench_radix(seqs, page_size, RADIX_REPEATS)}
    for op in ("insert", "match_hit", "match_partial"):
        r = rows[f"radix_{op}"]
        name = f"radix_{op}_ops_per_s_ps{page_size}"
        metric(f"{name}_python", r["n"] / r["python_s"], unit="seq/s")
        metric(f"{name}_rust", r["n"] / r["rust_s"], unit="seq/s")
        metric(f"{name}_rust_batch", r["n"] / r["rust_batch_s"], unit="seq/s")
    r = rows["radix_evict"]  # the whole cache, in 20 evict calls
    for impl, key in (("python", "python_s"), ("rust", "rust_s")):
        metric(f"radix_evict_all_ms_ps{page_size}_{impl}", r[key] * 1e3, unit="ms",
               higher_is_better=False)  # fmt: skip


@pytest.mark.card("P0-003", "admission-of-1000-requests-at-least-5x-the-python-reference")
def test_admission_micro(seqs, metric):
    # bench_admission asserts that both backends took the same number of steps and reached
    # the same prefix hit rate and final cache size
    r = bench_admission(seqs[:1000], 16, 1)
    metric("admission_1k_ms_python", r["python_s"] * 1e3, unit="ms", higher_is_better=False)
    metric("admission_1k_ms_rust", r["rust_s"] * 1e3, unit="ms", higher_is_better=False)


@pytest.mark.card(
    "P0-004", "scheduler-cpu-per-decode-step-at-batch-256-at-most-100-us-and-1-10-of-python"
)
def test_decode_step_micro(seqs, metric):
    r = bench_decode(seqs, 256, 16, 3, steps=20)
    us = dict(unit="us", higher_is_better=False)
    metric("decode_step_us_b256_python", r["python_s"] * 1e6, **us)
    metric("decode_step_us_b256_rust", r["rust_s"] * 1e6, **us)
    # with the LLM.step glue (per-row params lists, output iteration): recorded, not gated
    metric("decode_step_with_glue_us_b256_python", r["python_with_llm_glue_s"] * 1e6, **us)
    metric("decode_step_with_glue_us_b256_rust", r["rust_with_llm_glue_s"] * 1e6, **us)
