"""Prefill attention is one padded (varlen) SDPA call per step, not one per request."""

from __future__ import annotations

import numpy as np

import minisgl.attention.torch_native as tn
from minisgl import LLM, SamplingParams
from minisgl.testing.scenarios import cpu_attention, random_prompts


def test_similar_lengths_share_one_call():
    groups = tn._prefill_groups(np.array([5, 7, 6, 30]), np.array([5, 7, 6, 30]))
    assert [g.tolist() for g in groups] == [[0, 1, 2, 3]]


def test_one_long_prompt_is_not_padded_against_many_short_ones():
    ext = np.array([2000] + [8] * 20)
    groups = tn._prefill_groups(ext, ext.copy())
    assert len(groups) == 2 and groups[0][0] == 0
    assert sorted(int(r) for g in groups for r in g) == list(range(21))
    for g in groups:  # padding at most doubles a group's attention work (plus the slack)
        padded = len(g) * int(ext[g].max()) ** 2
        assert padded <= tn._PAD_FACTOR * int((ext[g] ** 2).sum()) + tn._PAD_SLACK


def test_a_prefill_step_of_32_requests_makes_one_sdpa_call_per_layer(tiny_model_dir, monkeypatch):
    # the padded SDPA call (CUDA, or a CPU without the C kernels: short requests go through
    # the prefill kernel otherwise, tests/test_cpu_prefill_kernel.py)
    with cpu_attention("sdpa"):
        llm = LLM(tiny_model_dir("llama"), num_pages=2048, max_seq_len_override=256)
    assert llm.engine.backend.prefill_kernel_rows == 0
    calls = []
    real = tn.F.scaled_dot_product_attention

    def counting(q, *args, **kw):
        calls.append(tuple(q.shape))
        return real(q, *args, **kw)

    monkeypatch.setattr(tn.F, "scaled_dot_product_attention", counting)
    prompts = random_prompts(32, 4, 24, seed=1)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    layers = llm.engine.model_config.num_layers
    assert len(calls) == layers  # one prefill step, one call per layer (and no decode step)
    assert calls[0][0] == 32
