"""GGUF tensors -> packed int4 / int8 weights under HF parameter names, block by block.

Q4_1 blocks become int4 groups exactly (scale = d, zero = m + 8 d); Q8_0 rows are re-quantized
per output channel for int8. Other block types (Q4_K, Q6_K, F16...) go through gguf-py's
de-quantizer and are re-quantized. Q and K projections of `llama` files are un-permuted the way
transformers' GGUF loader does (llama.cpp stores them in its interleaved RoPE order), rows only, so the
blocks stay intact.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from minisgl.quantization.packed import (
    Int4Weight,
    Int8Weight,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
)

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = 32


def hf_name(gguf_name: str) -> str | None:
    """HF name of a GGUF linear / embedding weight (None for norms and other tensors)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    return None


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation (transformers' reverse_permute)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).view(n_head, dim, 2).transpose(1, 2).reshape(-1)


def _q4_1(raw: np.ndarray, n: int, k: int) -> Int4Weight:
    blocks = raw.reshape(n, k // _BLOCK, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]  # element j in the low nibble of byte j, element j + 16 in the high one
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).reshape(n, k)
    scale, mn = torch.from_numpy(d), torch.from_numpy(m)
    return Int4Weight(pack_nibbles(torch.from_numpy(codes)), scale, mn + 8 * scale)


def _q8_0(raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    blocks = raw.reshape(n, k // _BLOCK, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    return torch.from_numpy((q * d[..., None]).reshape(n, k))


def read_gguf_weights(path: Path, method: str, num_heads: int, num_kv_heads: int):
    """{HF name: Int4Weight | Int8Weight} for every linear / embedding weight in the file.

    The embedding (and an untied lm_head) is always int8: it is the output projection too.
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch_field = reader.fields["general.architecture"]
    permuted = bytes(arch_field.parts[arch_field.data[0]]).decode() == "llama"
    out: dict[str, Int4Weight | Int8Weight] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        k, n = (int(x) for x in t.shape[:2])  # GGUF lists dims innermost first
        kind = t.tensor_type.name
        dense = method == "int8" or name in ("model.embed_tokens.weight", "lm_head.weight")
        if kind == "Q4_1" and not dense:
            w: Int4Weight | Int8Weight = _q4_1(np.asarray(t.data), n, k)
        else:
            if kind == "Q8_0":
                f = _q8_0(np.asarray(t.data), n, k)
            elif kind == "Q4_1":
                f = _q4_1(np.asarray(t.data), n, k).dequantize()
            else:
                f = torch.from_numpy(
                    np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
                ).reshape(n, k)
            w = quantize_int8(f) if dense else quantize_int4(f)
        heads = {"q_proj": num_heads, "k_proj": num_kv_heads}.get(name.split(".")[-2])
        if permuted and heads is not None:
            rows = _unpermute_rows(n, heads)
            w = type(w)(*(getattr(w, f)[rows] for f in w.__dataclass_fields__))
        out[name] = w
    return out
