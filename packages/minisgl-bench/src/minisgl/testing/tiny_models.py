"""Tiny random-weight models of every supported architecture, for tests and benchmarks.

`write_tiny_model("llama", path, seed=0)` writes config.json, model.safetensors and a small
byte-level BPE tokenizer (with a ChatML template) to `path`, deterministic from the seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")  # mixture-of-experts: their own tests
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "Batching helps GPU utilization because many requests share one forward pass. "
    "A radix tree shares prefixes between prompts; chunked prefill splits long prompts. "
    "0123456789 !?,.;:'\"()[]{}<>+-*/=_ abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ"
)


def _config(arch: str, vocab: int, **overrides: Any):
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":
        cfg = LlamaConfig(**{**common, "tie_word_embeddings": False, **overrides})
    elif arch == "qwen2":
        cfg = Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
    elif arch == "qwen3":
        cfg = Qwen3Config(
            **{**common, "tie_word_embeddings": False, "num_hidden_layers": 3, **overrides}
        )
    elif arch == "mistral":
        cfg = MistralConfig(
            **{**common, "tie_word_embeddings": False, "sliding_window": 48, **overrides}
        )
    elif arch == "qwen3_moe":  # 4 layers: layer 2 dense (mlp_only_layers), the others MoE
        moe = dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=3,
                   moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[2])  # fmt: skip
        cfg = Qwen3MoeConfig(**{**common, "tie_word_embeddings": False, **moe, **overrides})
    elif arch == "mixtral":
        moe = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                   sliding_window=48)  # fmt: skip
        cfg = MixtralConfig(**{**common, "tie_word_embeddings": False, **moe, **overrides})
    else:
        names = ARCHITECTURES + MOE_ARCHITECTURES
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {names}")
    return cfg


def write_tokenizer(path: Path, vocab_size: int = 384) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return tok.get_vocab_size()


def write_tiny_model(
    arch: str, path: str | Path, seed: int = 0, max_shard_size: str | None = None, **overrides: Any
) -> Path:
    """Write a tiny random model of `arch` (llama, qwen2, qwen3, mistral; the MoE qwen3_moe,
    mixtral) to `path`.

    `max_shard_size` (e.g. "40KB") writes sharded safetensors with an index file; other
    keyword arguments override the transformers config (e.g. `rope_scaling`).
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    cfg = _config(arch, vocab, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kw)
    return path
