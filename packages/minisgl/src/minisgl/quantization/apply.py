"""Swap a loaded model's linears for quantized ones (int8 per channel / int4 group-wise).

Weights come from a packed cache (exact GGUF blocks, `packed_cache.py`) where it has them,
else they are quantized from the model's float weights. The (tied) embedding / lm_head is
int8 (int4 in int4 mode, re-quantized from the int8 rows: see the comment in
`quantize_model`); the tied embedding lookup reads the int8 rows.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from minisgl.config import ModelConfig
from minisgl.models.llama import STACKED_PARAMS
from minisgl.models.moe import SparseMoeBlock
from minisgl.quantization.experts import QuantizedExperts
from minisgl.quantization.linear import Int4Linear, Int8Embedding, Int8Linear, int4_supported
from minisgl.quantization.packed import (
    Int4Weight,
    Int8Weight,
    concat_int4,
    concat_int8,
    quantize_int4,
    quantize_int8,
)
from minisgl.quantization.w8a8 import W8A8MLP, W8A8Linear

PackedWeights = dict[str, Int4Weight | Int8Weight]
_LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _shard_names(prefix: str, fused: str) -> list[str]:
    shards = sorted((i, n) for n, (f, i) in STACKED_PARAMS.items() if f == fused)
    return [f"{prefix}.{n}.weight" for _, n in shards]


def _weight(
    module: nn.Linear, name: str, method: str, packed: PackedWeights | None
) -> Int4Weight | Int8Weight:
    prefix, leaf = name.rsplit(".", 1)
    names = (
        _shard_names(prefix, leaf) if leaf in ("qkv_proj", "gate_up_proj") else [name + ".weight"]
    )
    if packed is not None and all(n in packed for n in names):
        parts = [packed[n] for n in names]
        want = Int4Weight if method == "int4" else Int8Weight
        if all(isinstance(p, want) for p in parts):
            return concat_int4(parts) if want is Int4Weight else concat_int8(parts)  # type: ignore[arg-type]
    w = module.weight.detach()
    return quantize_int4(w) if method == "int4" else quantize_int8(w)


def quantize_model(
    model: nn.Module,
    cfg: ModelConfig,
    method: str,
    dtype: torch.dtype,
    packed: PackedWeights | None = None,
) -> None:
    """Replace every decoder linear and the lm_head in place; `method` is int8, int4 or w8a8
    (int8 weights of the smoothed float model, `W8A8Linear`). A MoE block's experts become
    `QuantizedExperts` (int8 / int4; its router stays float)."""
    for i, layer in enumerate(model.model.layers):
        moe = isinstance(layer.mlp, SparseMoeBlock)
        if moe:
            layer.mlp.experts = QuantizedExperts(layer.mlp.experts, method, dtype)
        for rel in _LAYER_LINEARS:
            if moe and rel.startswith("mlp."):
                continue
            parent_name, leaf = rel.split(".")
            parent = getattr(layer, parent_name)
            lin: nn.Linear = getattr(parent, leaf)
            name = f"model.layers.{i}.{rel}"
            use = "int8" if method == "w8a8" else method
            if use == "int4" and not int4_supported(lin.out_features, lin.in_features):
                use = "int8"
            w = _weight(lin, name, use, packed)
            if method == "w8a8":
                cls = W8A8Linear
            else:
                cls = Int4Linear if isinstance(w, Int4Weight) else Int8Linear
            bias = None if lin.bias is None else lin.bias.detach()
            setattr(parent, leaf, cls(w, bias, dtype))  # type: ignore[arg-type]
    head = model.lm_head
    src = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    hw = packed.get(src) if packed is not None else None
    if not isinstance(hw, Int8Weight):
        hw = quantize_int8(head.weight.detach())
    head8 = Int8Linear(hw, None, dtype)
    if method == "int4" and int4_supported(*hw.q.shape):
        # int4 everywhere: PyTorch's int8 kernel crashes (SIGSEGV in _weight_int8pack_mm)
        # when it runs after the int4 kernel in one process (torch 2.15, seen on batched
        # steps); the int8 rows still serve the embedding lookup
        model.lm_head = Int4Linear(quantize_int4(hw.dequantize()), None, dtype)
    else:
        # w8a8 too: the logits from bf16 activations. With int8 ones (per row) the embedded
        # model's perplexity was 1.1-1.5% higher as the geometric mean over 11 texts (47.7 /
        # 48.2 against 47.2 / 47.5; fp32 46.9); this costs ~1 ms a batch-128 decode step
        # (4.7 against 3.6 ms) and ~10 ms a many-short prefill step
        model.lm_head = head8
    if cfg.tie_word_embeddings:
        model.model.embed_tokens = Int8Embedding(head8)
    if method == "w8a8" and os.environ.get("MINISGL_W8A8_FUSED", "1") != "0":
        fuse_w8a8_inputs(model)


def fuse_w8a8_inputs(model: nn.Module) -> None:
    """Each w8a8 decoder layer's input norms move into the linears they feed (QKV, gate/up:
    `W8A8Linear.fold_norm`, the layer's norm an identity), and its MLP becomes `W8A8MLP`: the
    norm or SiLU x up and the per-row quantization are one pass (`w8a8.quantize_input`).
    `MINISGL_W8A8_FUSED=0` keeps the unfused modules (the reference of the tests, an A/B)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj.fold_norm(layer.input_layernorm)
        mlp.gate_up_proj.fold_norm(layer.post_attention_layernorm)
        layer.input_layernorm = nn.Identity()
        layer.post_attention_layernorm = nn.Identity()
        layer.mlp = W8A8MLP(mlp.gate_up_proj, mlp.down_proj)
