"""The torch-native decode workspace (decode through SDPA; the CPU C kernel reads the pool in
place): appends between decode steps, rebuilds otherwise, and gives exactly the tokens of the
plain gather path (and of HF)."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.scenarios import assert_kv_clean, cpu_attention, random_prompts

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def generate(path, budget_mb: str, monkeypatch, **kw):
    monkeypatch.setenv("MINISGL_DECODE_WORKSPACE_MB", budget_mb)
    with cpu_attention("sdpa"):
        llm = LLM(path, num_pages=4096, **kw)
    prompts = random_prompts(6, 5, 60, seed=21)
    # staggered max_tokens: requests finish at different steps, so the batch changes mid-run
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(6)]
    out = [o["token_ids"] for o in llm.generate(prompts, params)]
    assert_kv_clean(llm)
    return llm, prompts, out


@pytest.mark.card("P0-010", "greedy-decoding-token-identical-to-hf-at-page-size-1-and-16")
@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: sliding-window masking
def test_workspace_matches_gather_and_hf(arch, tiny_model_dir, monkeypatch):
    path = tiny_model_dir(arch)
    on, prompts, with_ws = generate(path, "512", monkeypatch)
    ws = on.engine.backend.workspace
    assert ws.appends > 0 and ws.rebuilds > 1  # both paths really ran
    off, _, without = generate(path, "0", monkeypatch)
    assert off.engine.backend.workspace.appends == 0
    assert with_ws == without
    ref = hf_greedy(load_hf_model(path), prompts, 6 + 3 * 5)
    assert with_ws == [r[: 6 + 3 * i] for i, r in enumerate(ref)]


def test_workspace_budget_falls_back_to_gather(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("MINISGL_DECODE_WORKSPACE_MB", "0")
    with cpu_attention("sdpa"):
        llm = LLM(tiny_model_dir("qwen2"), num_pages=1024)
    out = llm.generate(random_prompts(2, 10, 20, seed=3), GREEDY)
    assert [len(o["token_ids"]) for o in out] == [16, 16]
    ws = llm.engine.backend.workspace
    assert ws.appends == ws.rebuilds == 0 and ws.k is None
