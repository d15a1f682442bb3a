"""Prefill steps through `torch.compile` on the CPU, piecewise around attention (card P2-003).

With compile on, the layers of a prefill step run as two compiled pieces each (norm, QKV and
RoPE before attention; o_proj, residual, norm and MLP after it) around the eager attention
call, with the token count dynamic: one pair of graphs, compiled at start, serves every prefill
length. fp32 stays token-identical to HF through prefix hits and chunked prefill.
"""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.scenarios import assert_kv_clean, random_prompts
from minisgl.testing.tiny_models import write_tiny_model

PREFILL = "prefill-steps-run-compiled-around-attention-token-identical-to-hf-in-fp32"


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.card("P2-003", "failing-tests-compiled-prefill")
@pytest.mark.card("P2-003", PREFILL)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q / k norms in the first piece
def test_compiled_prefill_matches_hf_fp32(arch, tmp_path):
    """Fresh prompts, prefix hits and chunked prefill (max_extend_tokens=96) of many lengths,
    all through the graphs compiled at start; every layer reads its own weights (the pieces
    take the layer as an input: one graph for all layers)."""
    path = write_tiny_model(arch, tmp_path / arch, seed=3)
    llm = LLM(path, dtype="float32", enable_torch_compile=True, num_pages=4096,
              max_seq_len_override=256, max_extend_tokens=96)  # fmt: skip
    prefill = getattr(llm.engine, "compiled_prefill", None)
    assert prefill is not None, "prefill steps are not compiled"
    graphs = _compiled_graphs()
    steps = prefill.steps
    system = random_prompts(1, 40, 40, seed=5)[0]
    prompts = [system + p for p in random_prompts(4, 2, 60, seed=6)]
    prompts += random_prompts(3, 70, 150, seed=7)
    got = llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    got += llm.generate(prompts[1:], SamplingParams(max_tokens=10, ignore_eos=True))
    assert _compiled_graphs() == graphs, "serving compiled a new graph"
    assert prefill.steps - steps >= 4  # the first prompt, then chunks of 96 tokens
    assert llm.scheduler.stats.cached_prompt_tokens >= 3 * 32  # whole pages of the prefix
    want = hf_greedy(load_hf_model(path), prompts, 10)
    assert [o["token_ids"] for o in got] == [want[0][:4], *want[1:]]
    assert_kv_clean(llm)


@pytest.mark.card("P2-003", "failing-tests-compiled-prefill")
@pytest.mark.card("P2-003", PREFILL)
def test_compiled_prefill_agrees_with_eager_in_bf16(tmp_path):
    """bf16: the fused pieces round differently from eager ops (fp32 inside a fused kernel),
    so logits are close, not equal; prefill logits of a batch of prompts, compiled vs eager."""
    import torch

    from minisgl.config import EngineConfig
    from minisgl.engine.engine import Engine
    from minisgl.testing.plans import PlannedBatch

    path = write_tiny_model("llama", tmp_path / "m", seed=4)
    logits = {}
    for compile_ in (False, True):
        engine = Engine(EngineConfig(model_path=str(path), dtype="bfloat16",
                                     enable_torch_compile=compile_, num_pages=2048,
                                     max_seq_len_override=128))  # fmt: skip
        batch = PlannedBatch.for_engine(engine, [5, 17, 9, 30, 2], per_request=64, seed=3)
        logits[compile_] = engine.forward(batch.plan(True))
        if compile_:
            prefill = getattr(engine, "compiled_prefill", None)
            assert prefill is not None and prefill.steps == 1, "the prefill step ran eager"
    eager, comp = logits[False], logits[True]
    torch.testing.assert_close(comp, eager, atol=0.05 * float(eager.abs().max()), rtol=0.0)
    agree = int((comp.argmax(-1) == eager.argmax(-1)).sum())
    assert agree >= 4, f"greedy agreement {agree}/5"


@pytest.mark.card("P2-003", "failing-tests-compiled-prefill")
@pytest.mark.card("P2-003", PREFILL)
def test_one_token_prefill_runs_eager(tmp_path):
    """A one-token prefill (a prompt of one token, or a prefix hit leaving one) would
    specialise the dynamic token count to 1: a compile mid-serving. It runs eager."""
    path = write_tiny_model("llama", tmp_path / "m", seed=6)
    llm = LLM(path, dtype="float32", enable_torch_compile=True, num_pages=2048,
              max_seq_len_override=128)  # fmt: skip
    prefill = getattr(llm.engine, "compiled_prefill", None)
    assert prefill is not None, "prefill steps are not compiled"
    graphs, steps = _compiled_graphs(), prefill.steps
    prompts = [[17], [23]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    got = [o["token_ids"] for o in llm.generate(prompts[:1], params)]
    assert prefill.steps == steps and _compiled_graphs() == graphs
    got += [o["token_ids"] for o in llm.generate(prompts[1:], params)]
    assert got == hf_greedy(load_hf_model(path), prompts, 5)
    assert_kv_clean(llm)


@pytest.mark.card("P2-003", PREFILL)
def test_prefill_is_eager_when_compile_is_off(tmp_path):
    path = write_tiny_model("llama", tmp_path / "m", seed=6)
    llm = LLM(path, dtype="float32", num_pages=2048, max_seq_len_override=128)
    assert getattr(llm.engine, "compiled_prefill", None) is None


@pytest.mark.card("P2-003", PREFILL)
def test_each_model_keeps_its_own_prefill_graphs(tmp_path):
    """Module guards are skipped, so graphs cached on a shared code object would serve another
    model: a Llama's pieces (no q / k norms) ran a Qwen3 compiled after it in the same process,
    and its tokens were wrong from the first. Each model's pieces have their own cache."""
    prompts = random_prompts(3, 20, 50, seed=8)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for arch in ("llama", "qwen3"):
        path = write_tiny_model(arch, tmp_path / arch, seed=3)
        llm = LLM(path, dtype="float32", enable_torch_compile=True, num_pages=2048,
                  max_seq_len_override=128)  # fmt: skip
        got = [o["token_ids"] for o in llm.generate(prompts, params)]
        assert got == hf_greedy(load_hf_model(path), prompts, 4), arch
