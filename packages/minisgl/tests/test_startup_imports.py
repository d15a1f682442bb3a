"""An engine process starts without the imports it does not use: building the model on the meta
device must not run ops there (each imports torch._dynamo and sympy, ~2 s a process), and
reading config.json must not go through transformers' config classes (their validators import
`transformers.activations`, hub kernels and torch.distributed.tensor: ~3 s). Every server start
pays these once per engine process. The config read from the JSON must still be the one
transformers reads: the same fields for every architecture, with its defaults for the keys a
config leaves out."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minisgl.config import ModelConfig
from minisgl.testing.tiny_models import ARCHITECTURES

REPO = Path(__file__).resolve().parents[3]
HEAVY = ("torch._dynamo", "sympy", "transformers.utils.type_validators", "transformers")

PROBE = """
import sys
from minisgl.config import EngineConfig
from minisgl.engine.sim import make_engine
from minisgl.sampler import SamplingParams
for path in sys.argv[1:]:
    engine = make_engine(EngineConfig(model_path=path, num_pages=64, max_seq_len_override=64))
    del engine
print(sorted(m for m in {heavy!r} if m in sys.modules))
"""


def test_an_engine_starts_without_dynamo_sympy_or_transformers(tiny_model_dir):
    paths = [str(tiny_model_dir(arch)) for arch in ARCHITECTURES]
    code = PROBE.format(heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def hf_fields(path: Path) -> dict:
    """What the engine took from transformers' config before (the reference)."""
    from transformers import AutoConfig

    raw = json.loads((path / "config.json").read_text())
    arch = raw["architectures"][0]
    hf = AutoConfig.from_pretrained(str(path))
    heads = hf.num_attention_heads
    window = None
    if arch == "MistralForCausalLM" or getattr(hf, "use_sliding_window", False):
        window = getattr(hf, "sliding_window", None)
    params = getattr(hf, "rope_parameters", None) or {}
    return {
        "vocab_size": hf.vocab_size,
        "hidden_size": hf.hidden_size,
        "intermediate_size": hf.intermediate_size,
        "num_layers": hf.num_hidden_layers,
        "num_heads": heads,
        "num_kv_heads": getattr(hf, "num_key_value_heads", None) or heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        "rms_norm_eps": hf.rms_norm_eps,
        "max_position_embeddings": hf.max_position_embeddings,
        "tie_word_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
        "attention_bias": arch == "Qwen2ForCausalLM" or bool(getattr(hf, "attention_bias", False)),
        "sliding_window": window,
        "initializer_range": hf.initializer_range,
        "rope_type": params.get("rope_type", "default"),
        "rope_theta": params.get("rope_theta"),
    }


def ours(path: Path) -> dict:
    cfg = ModelConfig.from_dir(path)
    got = {k: v for k, v in dataclasses.asdict(cfg).items()}
    return {k: got.get(k) for k in hf_fields(path)}


def configs(tiny_model_dir, tmp_path) -> list[Path]:
    """The tiny models, the real configs in worklog/models, and each architecture's config with
    every optional key left out (transformers' defaults decide)."""
    out = [tiny_model_dir(arch) for arch in ARCHITECTURES]
    out += sorted(p.parent for p in (REPO / "worklog/models").glob("*/config.json"))
    optional = ("num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                "tie_word_embeddings", "attention_bias", "sliding_window", "use_sliding_window",
                "initializer_range", "rope_theta", "rope_scaling", "rope_parameters")  # fmt: skip
    for arch in ARCHITECTURES:
        raw = json.loads((tiny_model_dir(arch) / "config.json").read_text())
        for key in optional:
            raw.pop(key, None)
        bare = tmp_path / f"bare-{arch}"
        bare.mkdir()
        (bare / "config.json").write_text(json.dumps(raw))
    out += sorted(tmp_path.glob("bare-*"))
    legacy = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    legacy.pop("rope_parameters", None)
    for name, extra in {
        "legacy-theta": {"rope_theta": 500000.0},
        "legacy-linear": {"rope_theta": 20000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
        "qwen2-window": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                         "use_sliding_window": True, "sliding_window": 48},
    }.items():  # fmt: skip
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**legacy, **extra}))
        out.append(d)
    return out


def test_the_config_from_json_is_the_one_transformers_reads(tiny_model_dir, tmp_path):
    checked = 0
    for path in configs(tiny_model_dir, tmp_path):
        assert ours(path) == hf_fields(path), path.name
        checked += 1
    assert checked >= 4 + 2 + 4 + 3


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}])  # fmt: skip
def test_a_scaled_rope_still_matches_transformers_tables(tiny_model_dir, tmp_path, rope):
    """The RoPE types other than `default` still take their inverse frequencies from
    transformers (loaded only then)."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minisgl.models.layers import RotaryEmbedding

    raw = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    raw["rope_parameters"] = {**rope, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_dir(tmp_path)
    table = RotaryEmbedding(cfg, 32, torch.float32)
    inv, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](AutoConfig.from_pretrained(tmp_path), None)
    freqs = torch.arange(32, dtype=torch.float32)[:, None] * inv[None, :].float()
    want = torch.cat((freqs, freqs), dim=-1).cos() * scale
    assert torch.equal(table.cos, want)


def test_a_gguf_path_that_cannot_be_served_fails_before_torch_loads(tmp_path):
    """The launcher resolves a GGUF path before any worker starts: a file that is no GGUF model
    is refused from its header alone, without importing torch (~2-4 s of a failing start, 2
    cores: the prefix cache's manifest module had imported the packed weights' classes)."""
    bad = tmp_path / "model.Q4_0.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    code = ("import sys\nfrom minisgl.config import ModelLoadError\n"
            "from minisgl.gguf_model import resolve_model_path\n"
            "try:\n    resolve_model_path(sys.argv[1])\nexcept ModelLoadError as e:\n"
            "    print('refused', 'GGUF version 0' in str(e), 'torch' in sys.modules)\n")  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", code, str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MINISGL_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert out.stdout.split() == ["refused", "True", "False"], out.stdout + out.stderr[-2000:]
