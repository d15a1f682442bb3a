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


def test_the_offline_llm_warms_up_where_kernels_compile_at_first_use(tiny_model_dir):
    """`LLM(warm_up=None)`: on a CUDA device (Triton kernels compile at the first step of each
    shape, ~0.2-0.9 s each on the H200) the offline API warms up as a server does; on a CPU it
    does not unless asked (nothing to compile there but a compiled engine's graphs, which warm
    up always)."""
    from types import SimpleNamespace

    import torch

    from minisgl import LLM
    from minisgl.runtime.runtime import warms_up_by_default

    assert warms_up_by_default(SimpleNamespace(device=torch.device("cuda", 0)))
    assert not warms_up_by_default(SimpleNamespace(device=torch.device("cpu")))
    path = tiny_model_dir("llama")
    assert LLM(path, sim_device="0,0", num_pages=2048).runtime.warmup is None
    llm = LLM(path, sim_device="0,0", num_pages=2048, warm_up=True)
    assert llm.runtime.warmup is not None and llm.runtime.warmup.leaked_pages == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert len(out[0]["token_ids"]) == 2
