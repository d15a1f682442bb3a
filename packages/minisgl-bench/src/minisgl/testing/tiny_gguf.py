"""Tiny GGUF files of the four dense families and Qwen3-MoE, written as llama.cpp's converter
writes them.

`write_tiny_gguf("qwen3", path, "Q4_K")` writes a tiny random model (`tiny_models`, widened so
every linear's rows are whole 256-value K-quant super-blocks) as one GGUF file: the
`<arch>.*` keys, the byte-level BPE tokenizer with its merges and ChatML template as
`tokenizer.ggml.*` / `tokenizer.chat_template`, norms in F32 and every linear and the
embedding in `tensor_type`. Llama and Mistral are stored as llama.cpp stores them: architecture
`llama` (Mistral's `general.name` says `mistral`, as transformers reads it), Q and K rows
permuted into llama.cpp's interleaved RoPE order. Qwen3-MoE (`qwen3moe`, as Qwen3-30B-A3B's
files): every layer a MoE block, each layer's experts stacked into one 3-D tensor per projection
(`ffn_{gate,up,down}_exps`, [experts, rows, columns]), the router `ffn_gate_inp` kept in F32 (as
llama.cpp's quantizer keeps it) and the `expert_*` keys. Mixtral as llama.cpp stores it:
architecture `llama` with `llama.expert_count` / `expert_used_count` and the same stacked
experts (`w1`, `w3`, `w2`: gate, up, down), no sliding window.

Types gguf-py quantizes (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are quantized from the
model's weights; the K-quants (Q2_K..Q6_K), which gguf-py only de-quantizes, are random valid
blocks (random codes and sub-block scales, the super-block scales `d` / `dmin` set so the
weights' standard deviation is the model's): the reference is the file's de-quantized values
either way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from minisgl.testing.tiny_models import write_tiny_model

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
MOE_FAMILIES = ("qwen3_moe", "mixtral")
_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
         "qwen3_moe": "qwen3moe", "mixtral": "llama"}  # fmt: skip
QUANTIZED_BY_GGUF = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
TENSOR_TYPES = QUANTIZED_BY_GGUF + K_QUANTS
# the K-quants' fp16 super-block scales: byte offsets of d (and dmin) in a block
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# widened so every linear's input dimension is a multiple of 256 (K-quant super-blocks)
SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64, initializer_range=0.05)
# Qwen3-MoE: every layer sparse (llama.cpp's qwen3moe has no dense layers); experts of 512 rows, not
# the hidden size, so that a transposed down projection cannot pass
MOE_SHAPE = {
    "qwen3_moe": dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=512, mlp_only_layers=[], decoder_sparse_step=1),
    # Mixtral's experts are `intermediate_size` wide; llama.cpp has no sliding window
    "mixtral": dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=None),
}  # fmt: skip
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
            "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}  # fmt: skip

_LEAVES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # a MoE block's router (Qwen3-MoE; Mixtral below)
    "block_sparse_moe.gate": "ffn_gate_inp",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf: str) -> str:
    """GGUF tensor name of an HF parameter name (llama.cpp's `tensor_mapping`)."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
           "model.norm.weight": "output_norm.weight"}  # fmt: skip
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LEAVES[module]}.{kind}"


def stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`tensors` with each layer's per-expert projections (`model.layers.{i}.mlp.experts.{e}.
    {gate,up,down}_proj.weight`) stacked in expert order under their GGUF names
    (`blk.{i}.ffn_{gate,up,down}_exps.weight`, [experts, rows, columns]), as llama.cpp's
    converter stacks them; the other tensors keep their HF names."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, w in tensors.items():
        parts = name.split(".")
        if len(parts) == 8 and parts[4] == "experts":  # mlp. / block_sparse_moe.experts
            g = f"blk.{parts[2]}.{_EXPERTS[parts[6]]}.weight"
            stacks.setdefault(g, {})[int(parts[5])] = w
        else:
            out[name] = w
    for g, experts in stacks.items():
        out[g] = np.stack([experts[e] for e in range(len(experts))])
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` of Q / K rows (weights or biases)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def k_quant_blocks(rows: int, cols: int, kind: str, std: float, seed: int) -> np.ndarray:
    """Random valid `kind` blocks for a [rows, cols] tensor (uint8 [rows, bytes]) whose
    de-quantized values have standard deviation `std`."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    shape = gguf.quant_shape_to_byte_shape((rows, cols), qtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)
    blocks = raw.reshape(rows, cols // 256, -1)

    def set_scales(value: float) -> None:
        for off in _K_SCALES[kind]:
            blocks[..., off : off + 2] = np.array([value], np.float16).view(np.uint8)

    set_scales(1.0)
    unit = float(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float64).std())
    set_scales(std / unit)
    return raw


def _tokenizer_metadata(writer: Any, folder: Path) -> int:
    """The folder's byte-level BPE tokenizer as `tokenizer.ggml.*` keys; its vocabulary size."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in spec["added_tokens"]}
    vocab.update(specials)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[cfg["bos_token"]])
    writer.add_eos_token_id(vocab[cfg["eos_token"]])
    writer.add_pad_token_id(vocab[cfg["pad_token"]])
    writer.add_add_bos_token(False)
    template = folder / "chat_template.jinja"
    writer.add_chat_template(template.read_text() if template.is_file() else cfg["chat_template"])
    return len(tokens)


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for HF's `llama3` rope scaling (one
    divisor per frequency, fp32), with its defaults for missing keys."""
    from minisgl.gguf_rope import llama3_divisors

    return llama3_divisors(
        head_dim,
        theta,
        float(scaling.get("factor", 8.0)),
        float(scaling.get("low_freq_factor", 1.0)),
        float(scaling.get("high_freq_factor", 4.0)),
        float(scaling.get("original_max_position_embeddings", 8192)),
    ).astype(np.float32)


# SentencePiece files (Llama 2, Mistral 7B): `tokenizer.ggml.model` "llama", pieces with scores,
# byte-fallback tokens <0x00>..<0xFF>, BOS added; a handful of word pieces, the rest in bytes
SPM_PIECES = (
    "▁", "e", "t", "h", "a", "o", "l", "r", "s", "i", "n", "c", "p", "f", "P", "F", ".",
    "▁t", "he", "▁the", "▁a", "ll", "el", "hel", "▁h", "▁he", "▁hel", "▁hell", "▁hello",
    "is", "▁is", "▁in", "ar", "▁P", "▁Pa", "▁Par", "▁Pari", "▁Paris", "ca", "▁c", "▁ca",
    "▁cap", "it", "al", "▁of", "▁F", "▁Fr", "an", "ce", "▁France", "▁[", "INST", "]", "▁[/",
)  # fmt: skip
SPM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
    " [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
_SPM_TYPES = {"normal": 1, "unknown": 2, "control": 3, "byte": 6}


def spm_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of the tiny SentencePiece vocabulary: <unk> <s> </s>, the
    256 byte tokens, then SPM_PIECES (scores falling in that order)."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    kinds = ["unknown", "control", "control", *["byte"] * 256, *["normal"] * len(SPM_PIECES)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]
    return tokens, scores, [_SPM_TYPES[k] for k in kinds]


def _spm_tokenizer_metadata(writer: Any) -> int:
    """The tiny SentencePiece vocabulary as `tokenizer.ggml.*` keys; its size."""
    tokens, scores, types = spm_vocabulary()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(SPM_TEMPLATE)
    return len(tokens)


def rope_theta(hf: dict[str, Any]) -> float:
    """An HF config's RoPE base: transformers 5 saves it in `rope_parameters` (a top-level
    `rope_theta` in older configs; 10000 without either)."""
    theta = (hf.get("rope_parameters") or {}).get("rope_theta") or hf.get("rope_theta")
    return float(theta or 10000.0)


def _model_metadata(writer: Any, family: str, hf: dict[str, Any]) -> None:
    """The `<arch>.*` keys of an HF config (`expert_*` too for a MoE family)."""
    writer.add_name(family if family == "mistral" else f"tiny-{family}")
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_rope_dimension_count(hf["head_dim"])
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
    writer.add_rope_freq_base(rope_theta(hf))
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    if family in MOE_FAMILIES:
        writer.add_expert_count(hf.get("num_experts") or hf["num_local_experts"])
        writer.add_expert_used_count(hf["num_experts_per_tok"])
    if family == "qwen3_moe":
        writer.add_expert_feed_forward_length(hf["moe_intermediate_size"])


def _tensor_data(w: np.ndarray, kind: str, seed: int) -> np.ndarray:
    """`w` as GGUF `kind` data (K-quants: random valid blocks of `w`'s spread)."""
    import gguf

    if kind in K_QUANTS:
        rows = int(np.prod(w.shape[:-1]))
        data = k_quant_blocks(rows, w.shape[-1], kind, float(w.std()), seed)
        return data.reshape(*w.shape[:-1], -1)
    if kind == "F32":
        return w
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])


def _add_tensors(
    writer: Any, folder: Path, arch: str, hf: dict[str, Any], tensor_type: str,
    types: dict[str, str] | None, seed: int,
) -> None:  # fmt: skip
    """The folder's weights under their GGUF names: Q / K rows permuted for `llama`, experts
    stacked, norms and the router in F32, the rest in `tensor_type` (or `types[name]`)."""
    import gguf
    from safetensors.numpy import load_file

    heads = {"attn_q": hf["num_attention_heads"], "attn_k": hf["num_key_value_heads"]}
    tensors = stack_experts(load_file(str(folder / "model.safetensors")))
    for i, (name, w) in enumerate(sorted(tensors.items())):
        g = name if name.startswith("blk.") else gguf_name(name)
        w = w.astype(np.float32)
        leaf = g.split(".")[-2]
        if arch == "llama" and leaf in heads:
            w = _permute(w, heads[leaf])
        kind = (types or {}).get(g, tensor_type) if w.ndim >= 2 else "F32"
        kind = "F32" if leaf == "ffn_gate_inp" else kind  # llama.cpp keeps the router float
        data = _tensor_data(w, kind, seed * 1000 + i)
        # byte shapes: gguf derives the shape
        writer.add_tensor(g, data, raw_dtype=gguf.GGMLQuantizationType[kind])


def write_tiny_gguf(
    family: str, path: str | Path, tensor_type: str = "Q8_0", seed: int = 0,
    types: dict[str, str] | None = None, rope_scaling: dict[str, Any] | None = None,
    rope_factors: np.ndarray | None = None, tokenizer: str = "bpe",
) -> Path:  # fmt: skip
    """Write a tiny random `family` model (one of FAMILIES or MOE_FAMILIES) as the GGUF file
    `path` with its linears and embedding in `tensor_type` (`types`: a type per GGUF tensor
    name instead, e.g. Q6_K for `ffn_down` as in llama.cpp's _M mixes); the HF folder it came
    from is `path` + `.hf`.

    `rope_scaling` (HF's `llama3` dict) goes into the HF folder's config and, as llama.cpp
    stores it, into the file as the `rope_freqs.weight` tensor (`rope_factors`: that tensor's
    values instead, e.g. ones no `llama3` parameters produce). `tokenizer="spm"`: the tiny
    SentencePiece vocabulary (`spm_vocabulary`, Mistral's [INST] template) instead of the HF
    folder's byte-level BPE, whose tokenizer then is not the file's."""
    import gguf

    if family not in FAMILIES + MOE_FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES + MOE_FAMILIES}")
    path = Path(path)
    if tokenizer not in ("bpe", "spm"):
        raise ValueError(f"tokenizer: bpe or spm, got {tokenizer!r}")
    extra: dict[str, Any] = {"rope_scaling": rope_scaling} if rope_scaling else {}
    if family in MOE_FAMILIES:
        extra.update(MOE_SHAPE[family])
    if tokenizer == "spm":
        extra["vocab_size"] = len(spm_vocabulary()[0])
    folder = write_tiny_model(
        family, path.with_name(path.name + ".hf"), seed=seed, **SHAPE, **extra
    )
    hf = json.loads((folder / "config.json").read_text())
    arch = _ARCH[family]
    writer = gguf.GGUFWriter(str(path), arch)
    _model_metadata(writer, family, hf)
    if tokenizer == "spm":
        writer.add_vocab_size(_spm_tokenizer_metadata(writer))
    else:
        writer.add_vocab_size(_tokenizer_metadata(writer, folder))
    _add_tensors(writer, folder, arch, hf, tensor_type, types, seed)
    if rope_scaling and rope_factors is None:
        theta = rope_theta(hf)
        rope_factors = llama3_rope_factors(hf["head_dim"], theta, rope_scaling)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_factors, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
