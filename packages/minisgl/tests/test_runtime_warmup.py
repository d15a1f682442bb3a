"""Issue 39: a serving engine warms up before it reports ready: prefills of a few shapes, a
prefill on a cached prefix and decode steps of a few batch sizes, through the runtime's own
step loop; afterwards every KV page is free and the scheduler's counters start at zero."""

from __future__ import annotations

import pytest

from minisgl.config import EngineConfig
from minisgl.core import SamplingParams
from minisgl.engine.sim import make_engine
from minisgl.message.warmup import WarmUpReport
from minisgl.runtime import Runtime


@pytest.mark.parametrize(("overlap", "sim"), [(False, "0,0"), (True, None)])
def test_warm_up_runs_shapes_then_every_page_is_free(tiny_model_dir, overlap, sim):
    """The simulated device serially, the tiny model with a step in flight (the python
    engine worker's loop)."""
    config = EngineConfig(
        model_path=str(tiny_model_dir("llama")),
        num_pages=2048,
        max_seq_len_override=128,
        sim_device=sim,
    )
    engine = make_engine(config)
    rt = Runtime.build(engine, backend="python", overlap=overlap, warm_up=True)
    try:
        w = rt.warmup
        assert w is not None and w.kind == "shapes"
        assert len(w.prefill_lengths) >= 3 and 1 in w.prefill_lengths
        assert max(w.prefill_lengths) <= engine.config.max_extend_tokens
        assert w.prefix_extend and w.decode_batches[0] == 1 and len(w.decode_batches) >= 2
        assert w.steps > len(w.prefill_lengths) + len(w.decode_batches)  # decodes ran too
        assert w.requests == len(w.prefill_lengths) + 2 + sum(w.decode_batches)
        assert w.leaked_pages == 0 and w.seconds >= 0
        kv = rt.scheduler.kv_usage()
        assert kv["free_pages"] == kv["total_pages"] and kv["cached_tokens"] == 0
        assert rt.scheduler.stats.steps == 0 and rt.scheduler.stats.prompt_tokens == 0
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        rid = rt.add([5, 6, 7], params)  # serving goes on on the fresh scheduler
        tokens = []
        while rt.has_work():
            tokens += [o.token_id for o in rt.step().outputs if o.rid == rid]
        assert len(tokens) == 3
    finally:
        rt.close()
    assert WarmUpReport.from_info({"warmup": w.info()}) == w


def test_no_warm_up_unless_asked(tiny_model_dir):
    engine = make_engine(EngineConfig(model_path=str(tiny_model_dir("llama")), sim_device="0,0"))
    rt = Runtime.build(engine, backend="python", overlap=False)
    try:
        assert rt.warmup is None  # the offline LLM: only a compiled engine's graphs warm up
        assert rt.ensure_warm().kind == "shapes" and rt.ensure_warm() is rt.warmup  # once
    finally:
        rt.close()


def test_warm_up_report_from_an_older_worker_is_none():
    assert WarmUpReport.from_info({}) is None
    assert WarmUpReport.from_info({"warmup": "garbage"}) is None
