"""Benchmark evidence for the typed transport: a small run of `minisgl.benchmark.transport`.

Typed and generic codecs encode + decode the same hot-path messages (a 1k-token AddReq, a
64-wide TokenOut, a 64-wide DetokOut) in one process, interleaved, with the benchmark's own
`workloads` and `bench` functions; the median round trips of a few repeats are recorded as
ops/s through cardgate's `metric` fixture. The thresholds live in `worklog/gates/P0-006.yaml`
(typed >= k x generic, measured side by side), with k well below what
`worklog/baselines/transport-cpu.json` shows, because this 2-core machine is shared and noisy.
"""

from __future__ import annotations

import statistics

import pytest

from minisgl.benchmark.transport import bench, workloads
from minisgl.message.schema import Codec

REPEATS = 5  # medians of 5: one preempted repeat does not move the result
MIN_TIME_S = 0.05

pytestmark = pytest.mark.bench

NAMES = {"add_req": "add_req_1024tok", "token_out": "token_out_bs64", "detok_out": "detok_out_bs64"}


@pytest.mark.card(
    "P0-006",
    "typed-encode-and-decode-at-least-2x-the-generic-path-on-the-transport-microbenchmark",
)
def test_transport_typed_vs_generic(metric):
    msgs = workloads(64, 1024)
    codecs = {"typed": Codec(True), "generic": Codec(False)}
    for short, name in NAMES.items():
        us: dict[str, list[float]] = {"typed": [], "generic": []}
        for _ in range(REPEATS):
            for impl, codec in codecs.items():  # interleaved: both see the same machine load
                r = bench(codec, msgs[name], MIN_TIME_S)
                us[impl].append(r["roundtrip_us"])
        for impl, samples in us.items():
            metric(
                f"transport_{short}_roundtrip_ops_per_s_{impl}",
                1e6 / statistics.median(samples),
                unit="ops/s",
            )
