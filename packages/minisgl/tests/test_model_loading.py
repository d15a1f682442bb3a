"""Checkpoint forms: sharded safetensors, RoPE scaling variants, tied embeddings, dtypes."""

from __future__ import annotations

import json

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.scenarios import assert_kv_clean, random_prompts
from minisgl.testing.tiny_models import write_tiny_model

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.mark.card("P0-010", "sharded-checkpoints-rope-scaling-variants-and-half-precision")
def test_sharded_checkpoint_loads_and_matches_hf(tmp_path):
    path = write_tiny_model("qwen2", tmp_path, seed=3, max_shard_size="60KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really sharded
    prompts = random_prompts(2, 5, 30, seed=12)
    llm = LLM(path, num_pages=1024)
    assert [o["token_ids"] for o in llm.generate(prompts, GREEDY)] == hf_greedy(
        load_hf_model(path), prompts, 10
    )
    assert_kv_clean(llm)


@pytest.mark.card("P0-010", "missing-weights-and-unknown-architectures-are-clear-errors")
def test_missing_shard_is_reported(tmp_path):
    from minisgl.config import ModelLoadError

    path = write_tiny_model("llama", tmp_path, seed=3, max_shard_size="60KB")
    shard = sorted(path.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        LLM(path, num_pages=64)


@pytest.mark.card("P0-010", "sharded-checkpoints-rope-scaling-variants-and-half-precision")
@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ],
    ids=["linear", "llama3", "yarn"],
)
def test_rope_scaling_variants_match_hf(tmp_path, rope_scaling):
    path = write_tiny_model(
        "llama", tmp_path, seed=5, rope_scaling=rope_scaling, rope_theta=10000.0
    )
    prompts = random_prompts(2, 60, 120, seed=13)
    llm = LLM(path, num_pages=1024)
    ours = [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
    assert ours == hf_greedy(load_hf_model(path), prompts, 10)


@pytest.mark.card("P0-010", "missing-weights-and-unknown-architectures-are-clear-errors")
def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from minisgl.config import ModelLoadError

    path = write_tiny_model("llama", tmp_path, seed=1)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(path, num_pages=64)


@pytest.mark.card("P0-010", "sharded-checkpoints-rope-scaling-variants-and-half-precision")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_fp32(tiny_model_dir, dtype):
    path = tiny_model_dir("qwen3")
    prompt = random_prompts(1, 20, 20, seed=14)
    llm = LLM(path, dtype=dtype, num_pages=512)
    assert llm.engine.pool.k[0].dtype == getattr(torch, dtype)
    assert next(llm.engine.model.parameters()).dtype == getattr(torch, dtype)
    ref = LLM(path, dtype="float32", num_pages=512)
    # first-step logits agree within half-precision tolerance
    logits = {}
    for name, m in (("half", llm), ("fp32", ref)):
        m.scheduler.add_request(prompt[0], GREEDY)
        plan, _ = m.scheduler.schedule()
        logits[name] = m.engine.forward(plan)
        m.scheduler.abort(next(iter(m.scheduler.requests)))
    assert logits["half"].dtype == getattr(torch, dtype)  # widened by the sampler, not before
    torch.testing.assert_close(logits["half"].float(), logits["fp32"], atol=0.1, rtol=0.05)
    out = llm.generate(prompt, GREEDY)[0]
    assert len(out["token_ids"]) == 10
