"""GGUF tensors -> packed int4 / int8 weights under HF parameter names, block by block.

4-bit blocks become int4 groups of 32 without re-quantization, codes copied as they are:
Q4_0 (w = d (q - 8): scale = d, zero = 0), Q4_1 (w = d q + m: scale = d, zero = m + 8 d) and
Q4_K (super-blocks of 8 groups, w = d sc_j q - dmin m_j with 6-bit sc_j / m_j: scale = d sc_j,
zero = 8 d sc_j - dmin m_j). Q8_0 rows are re-quantized per output channel for int8 (the packed
int8 kernel has one scale per channel) straight from the int8 blocks. Other block types (Q5_*,
Q6_K, F16...) and the cross-class cases (Q8_0 in int4 mode, 4-bit blocks in int8 mode) go
through an in-memory de-quantization and are re-quantized; nothing float is written to disk. Q and K projections of `llama` files are un-permuted the way
transformers' GGUF loader does (llama.cpp stores them in its interleaved RoPE order), rows only, so the
blocks stay intact.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minisgl.gguf_rope import TENSOR as ROPE_FREQS
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
# a MoE block: the router, and each projection's experts stacked in one [experts, rows, columns]
ROUTER = "ffn_gate_inp"
_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# HF names of a MoE block by model type: its router, its experts, each stack's projection
MOE_NAMES: dict[str, tuple[str, str, dict[str, str]]] = {
    "qwen3_moe": ("mlp.gate", "mlp.experts", dict(zip(_STACKS, ("gate_proj", "up_proj",
                                                                   "down_proj")))),
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts",
                dict(zip(_STACKS, ("w1", "w3", "w2")))),
}  # fmt: skip


_NORM_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
}


def _layer_name(gguf_name: str, names: dict[str, str], kinds: str = "weight") -> str | None:
    """`model.layers.{i}.{names[leaf]}.{kind}` of a `blk.{i}.{leaf}.{kind}` tensor, `kind`
    one of `kinds` (a regex alternation)."""
    m = re.fullmatch(rf"blk\.(\d+)\.(\w+)\.({kinds})", gguf_name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def hf_name(gguf_name: str) -> str | None:
    """HF name of a GGUF linear / embedding weight (None for norms and other tensors)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    return _layer_name(gguf_name, _LAYER_NAMES)


def float_name(gguf_name: str, moe: str | None = None) -> str | None:
    """HF name of any 2-D or 1-D tensor of a Llama-family GGUF file: linears and their biases
    (qwen2), the embedding (`model.embed_tokens.weight`, tied or not: the name transformers'
    `save_pretrained` keeps for a tied pair, and other engines read), the norms (qwen3's Q / K
    norms too), and the router of a MoE model of HF type `moe` (a key of MOE_NAMES)."""
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    router = {ROUTER: MOE_NAMES[moe][0]} if moe is not None else {}
    return (
        _layer_name(gguf_name, _NORM_NAMES)
        or _layer_name(gguf_name, _LAYER_NAMES, "bias")
        or _layer_name(gguf_name, router)
        or hf_name(gguf_name)
    )


def expert_names(gguf_name: str, count: int, moe: str) -> list[str] | None:
    """HF names (model type `moe`) of the `count` experts a stacked
    `blk.{i}.ffn_{gate,up,down}_exps.weight` holds, in its order (None for other tensors)."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    _, experts, projections = MOE_NAMES[moe]
    if m is None or m.group(2) not in projections:
        return None
    proj = projections[m.group(2)]
    return [f"model.layers.{m.group(1)}.{experts}.{e}.{proj}.weight" for e in range(count)]


def is_moe_tensor(gguf_name: str) -> bool:
    """A MoE block's router or stacked experts."""
    m = re.fullmatch(r"blk\.\d+\.(\w+)\.weight", gguf_name)
    return m is not None and (m.group(1) in _STACKS or m.group(1) == ROUTER)


@contextmanager
def one_parse_per_file() -> Iterator[None]:
    """Inside: every `gguf.GGUFReader(path)` of the same unchanged file returns one reader, ours
    and transformers' alike (its GGUF loader imports the class from gguf when called). Parsing
    the metadata is most of a read (the embedded model's vocabulary and merges: ~100k strings,
    ~3 s on 2 cores), and a conversion reads the file three times (config, tokenizer, weights).
    The readers are dropped at exit; not for use from several threads at once."""
    import gguf

    real = gguf.GGUFReader
    readers: dict[tuple[str, int, int], Any] = {}

    def shared(path: Any, mode: str = "r") -> Any:
        if mode != "r":
            return real(path, mode)
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_mtime_ns, st.st_size)
        if key not in readers:
            readers[key] = real(path)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = real
        readers.clear()


def read_gguf_float(path: Path, num_heads: int, num_kv_heads: int, moe: str | None = None):
    """{HF name: fp32 tensor} of every tensor of a Llama-family GGUF file, de-quantized by
    gguf's own `dequantize` and Q / K rows un-permuted as transformers' GGUF loader does (the
    same numbers its conversion writes, in one read of the file instead of its three); a MoE
    model's (HF type `moe`) stacked experts split into one tensor per expert, as its HF folder
    names them."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch_field = reader.fields["general.architecture"]
    permuted = bytes(arch_field.parts[arch_field.data[0]]).decode() == "llama"
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # RoPE scaling, read into the config (gguf_rope)
            continue
        shape = [int(x) for x in reversed(t.shape)]  # GGUF lists dims innermost first
        name = float_name(t.name, moe)
        experts = expert_names(t.name, shape[0], moe) if moe and len(shape) == 3 else None
        if name is None and experts is None:
            raise ValueError(f"{path.name}: no HF name for the GGUF tensor {t.name!r}")
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        f = torch.from_numpy(w.reshape(shape).copy())
        if experts is not None:
            out.update((n, e.clone()) for n, e in zip(experts, f, strict=True))
            continue
        heads = {"q_proj": num_heads, "k_proj": num_kv_heads}.get(name.split(".")[-2])
        if permuted and heads is not None:
            f = f[_unpermute_rows(f.shape[0], heads)].contiguous()
        out[name] = f
    return out


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


def _q4_0(raw: np.ndarray, n: int, k: int) -> Int4Weight:
    blocks = raw.reshape(n, k // _BLOCK, 18)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 2:]  # the Q4_1 nibble order
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).reshape(n, k)
    scale = torch.from_numpy(d)
    return Int4Weight(pack_nibbles(torch.from_numpy(codes)), scale, torch.zeros_like(scale))


_QK_K = 256  # k-quant super-block


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of each Q4_K super-block ([..., 12] bytes -> 2 x [..., 8]):
    bytes 0-3 hold sc 0-3 (low 6 bits) and the top 2 bits of sc 4-7, bytes 4-7 the same for
    the mins, bytes 8-11 the low 4 bits of sc 4-7 (low nibble) and m 4-7 (high nibble)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), axis=-1)
    return sc, mn


def _q4_k(raw: np.ndarray, n: int, k: int) -> Int4Weight:
    blocks = raw.reshape(n, k // _QK_K, 144)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [n, nb, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = _q4_k_scales(blocks[..., 4:16])
    scale = d * sc.astype(np.float32)  # [n, nb, 8]: exact (11-bit d times a 6-bit integer)
    low = dmin * mn.astype(np.float32)
    # qs: 4 chunks of 32 bytes; chunk c holds group 2c in its low nibbles, 2c + 1 in its high
    qs = blocks[..., 16:].reshape(n, k // _QK_K, 4, 1, 32)
    codes = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    scale_t = torch.from_numpy(scale.reshape(n, -1))
    zero = torch.from_numpy((8 * scale - low).reshape(n, -1))
    return Int4Weight(pack_nibbles(torch.from_numpy(codes.reshape(n, k))), scale_t, zero)


_INT4_BLOCKS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}


def _q8_0_int8(raw: np.ndarray, n: int, k: int) -> Int8Weight:
    """Q8_0 rows -> int8 per output channel, block by block: w = q d (exact in fp32), then
    `quantize_int8`'s rounding (s = max |w| / 127, q' = round(w / s)), one row at a time."""
    blocks = raw.reshape(n, k // _BLOCK, 34)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [n, nb, 1]
    w = blocks[..., 2:].copy().view(np.int8).astype(np.float32) * d
    s = np.maximum(np.abs(w).max(axis=(1, 2)) / np.float32(127.0), np.float32(1e-10))
    codes = np.clip(np.round(w / s[:, None, None]), -127, 127).astype(np.int8).reshape(n, k)
    return Int8Weight(torch.from_numpy(codes), torch.from_numpy(s.astype(np.float32)))


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

    from minisgl.quantization.gguf_index import read_index

    index = read_index(path)  # the tensors alone: no parse of the metadata's values
    permuted = index.architecture == "llama"
    out: dict[str, Int4Weight | Int8Weight] = {}
    for t in index.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        k, n = (int(x) for x in t.shape[:2])  # GGUF lists dims innermost first
        kind = t.tensor_type.name
        dense = method == "int8" or name in ("model.embed_tokens.weight", "lm_head.weight")
        raw = np.asarray(t.data)
        if kind in _INT4_BLOCKS and not dense:
            w: Int4Weight | Int8Weight = _INT4_BLOCKS[kind](raw, n, k)
        elif kind == "Q8_0" and dense:
            w = _q8_0_int8(raw, n, k)
        else:
            if kind == "Q8_0":
                f = _q8_0(raw, n, k)
            elif kind in _INT4_BLOCKS:
                f = _INT4_BLOCKS[kind](raw, n, k).dequantize()
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
