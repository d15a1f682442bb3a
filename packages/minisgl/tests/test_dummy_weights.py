"""`--dummy-weights`: the shipped real-architecture configs load random weights of the right
shapes, with no checkpoint, and generate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.config import ModelLoadError

MODELS = Path(__file__).resolve().parents[3] / "worklog" / "models"
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# the published configs' arithmetic, written out (not recomputed by the code under test):
# (qkv rows = (q heads + 2 kv heads) x head dim, o_proj, gate_up rows = 2 x intermediate, ...)
EXPECTED = {
    "Qwen2.5-0.5B-Instruct": dict(
        hidden=896, qkv=(14 + 2 * 2) * 64, o_in=14 * 64, inter=4864, vocab=151936,
        qkv_bias=True, qk_norm=None, tied=True,
    ),
    "Qwen3-0.6B": dict(
        hidden=1024, qkv=(16 + 2 * 8) * 128, o_in=16 * 128, inter=3072, vocab=151936,
        qkv_bias=False, qk_norm=128, tied=True,
    ),
}  # fmt: skip


def shallow_copy(name: str, dest: Path, layers: int = 2) -> Path:
    """The shipped folder with `num_hidden_layers` overridden (no weights in either)."""
    dest.mkdir()
    cfg = json.loads((MODELS / name / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (dest / "config.json").write_text(json.dumps(cfg))
    for f in TOKENIZER:
        shutil.copy(MODELS / name / f, dest / f)
    return dest


@pytest.mark.card(
    "P2-001", "shipped-qwen-configs-load-dummy-weights-of-the-right-shapes-on-the-cpu"
)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_config_loads_dummy_weights_and_generates(name, tmp_path):
    path = shallow_copy(name, tmp_path / name)
    assert not list(path.glob("*.safetensors"))
    llm = LLM(path, dummy_weights=True, device="cpu", dtype="float32",
              max_seq_len_override=64, num_pages=128, max_running_requests=4)  # fmt: skip
    e = EXPECTED[name]
    model = llm.engine.model
    layers = model.model.layers
    assert len(layers) == 2
    attn, mlp = layers[0].self_attn, layers[0].mlp
    assert tuple(attn.qkv_proj.weight.shape) == (e["qkv"], e["hidden"])
    assert (attn.qkv_proj.bias is not None) == e["qkv_bias"]
    if e["qkv_bias"]:
        assert tuple(attn.qkv_proj.bias.shape) == (e["qkv"],)
    assert tuple(attn.o_proj.weight.shape) == (e["hidden"], e["o_in"])
    assert tuple(mlp.gate_up_proj.weight.shape) == (2 * e["inter"], e["hidden"])
    assert tuple(mlp.down_proj.weight.shape) == (e["hidden"], e["inter"])
    assert tuple(model.model.embed_tokens.weight.shape) == (e["vocab"], e["hidden"])
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == e["tied"]
    if e["qk_norm"] is None:
        assert not hasattr(attn, "q_norm")
    else:
        assert tuple(attn.q_norm.weight.shape) == (e["qk_norm"],)
        assert tuple(attn.k_norm.weight.shape) == (e["qk_norm"],)
    # random, not uninitialised: finite, the init's scale, norms at 1
    w = attn.qkv_proj.weight
    assert torch.isfinite(w).all() and 0.015 < float(w.detach().std()) < 0.025
    assert torch.equal(layers[1].input_layernorm.weight, torch.ones(e["hidden"]))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8], "Hello there"], params)
    assert [len(o["token_ids"]) for o in out] == [6, 6]
    assert all(0 <= t < e["vocab"] for o in out for t in o["token_ids"])


@pytest.mark.card(
    "P2-001", "shipped-qwen-configs-load-dummy-weights-of-the-right-shapes-on-the-cpu"
)
def test_dummy_weights_are_deterministic_per_parameter_name(tiny_model_dir):
    from minisgl.config import ModelConfig
    from minisgl.models.loader import load_model

    cfg = ModelConfig.from_dir(tiny_model_dir("qwen2"))
    cpu = torch.device("cpu")
    a = load_model("", cfg, torch.float32, cpu, 64, dummy_weights=True)
    b = load_model("", cfg, torch.float32, cpu, 64, dummy_weights=True)
    c = load_model("", cfg, torch.bfloat16, cpu, 64, dummy_weights=True)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        assert torch.equal(pa.to(torch.bfloat16), pc), name  # drawn in fp32, then cast
    embed, qkv = a.model.embed_tokens.weight, a.model.layers[0].self_attn.qkv_proj.weight
    assert not torch.equal(embed[: qkv.shape[0], : qkv.shape[1]], qkv)  # one stream per name


@pytest.mark.card(
    "P2-001", "shipped-qwen-configs-load-dummy-weights-of-the-right-shapes-on-the-cpu"
)
def test_dummy_weights_without_config_is_a_clear_error(tmp_path):
    for f in TOKENIZER:
        shutil.copy(MODELS / "Qwen3-0.6B" / f, tmp_path / f)
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(tmp_path, dummy_weights=True, device="cpu")


def test_without_dummy_weights_a_config_only_folder_names_the_flag_gap(tmp_path):
    path = shallow_copy("Qwen3-0.6B", tmp_path / "q3")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(path, device="cpu", dtype="float32", max_seq_len_override=64, num_pages=128)


def test_dummy_weights_refuse_quantization(tmp_path):
    path = shallow_copy("Qwen3-0.6B", tmp_path / "q3")
    with pytest.raises(ModelLoadError, match="float only"):
        LLM(path, dummy_weights=True, device="cpu", quantization="int8",
            max_seq_len_override=64, num_pages=128)  # fmt: skip


def test_server_flag_reaches_the_engine_config():
    from minisgl.server.args import parse_args

    assert parse_args(["--dummy-weights"]).llm_kwargs()["dummy_weights"] is True
    assert parse_args([]).llm_kwargs()["dummy_weights"] is False


@pytest.mark.card(
    "P2-001", "shipped-qwen-configs-load-dummy-weights-of-the-right-shapes-on-the-cpu"
)
@pytest.mark.slow
def test_harness_runs_a_dummy_weight_model_against_hf(tmp_path):
    """`harness offline --dummy-weights --engine hf`: minisgl on dummy weights, HF from its own
    random init of the same config (a speed baseline), one JSON record."""
    import subprocess
    import sys

    path = shallow_copy("Qwen2.5-0.5B-Instruct", tmp_path / "q25", layers=1)
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "minisgl.benchmark.harness", "offline", "--no-progress",
           "--model-path", str(path), "--dummy-weights", "--engine", "hf", "--dtype", "float32",
           "--set", "num_requests=2", "--set", "output_len=3", "--set", "input_len_min=8",
           "--set", "input_len_max=8", "--set", "warmup_requests=1",
           "--set", "llm.max_seq_len_override=64", "--set", "llm.num_pages=64",
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["llm_kwargs"]["dummy_weights"] is True
    assert record["results"]["minisgl"]["metrics"]["output_tokens"] == 6
    assert record["results"]["hf"]["metrics"]["output_tokens"] == 6
