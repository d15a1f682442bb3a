"""A GGUF file as a model path: `LLM("model.gguf")`, `--model-path model.gguf`.

The file is checked first (a GGUF v2 / v3 of one of the four dense families or Qwen3-MoE, every
tensor of a type below), then converted once, under a file lock, into an HF folder in the user cache
(`<cache>/models/gguf/<key>/<file stem>/`, the key from the file's path, size and mtime, so a
changed file converts again): config and tokenizer (chat template included) from the file's
metadata through transformers' GGUF support, the weights de-quantized by gguf-py into fp32
safetensors (Q / K rows of `llama` files un-permuted, as transformers does; a MoE file's stacked
experts split per expert, the expert shape from its `expert_*` keys). The folder's
`packed/manifest.json` names the file and its precision class, so `quantization="auto"` serves
it in the project's packed format of that class, converted from the file's blocks
(`quantization/gguf.py`, cached in `packed/`); `quantization="none"` serves the de-quantized
fp32 weights exactly.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from minisgl.config import ModelLoadError
from minisgl.gguf_rope import TENSOR as ROPE_FREQS  # Llama 3.1+ RoPE scaling, a divisor a frequency
from minisgl.utils.log import get_logger

logger = get_logger(__name__)

# general.architecture -> served as; llama.cpp stores Mistral models as `llama`
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe")
# MoE files: general.architecture -> the `<arch>.*` keys they need. qwen3moe: Qwen3-MoE;
# `llama` with `llama.expert_count`: Mixtral, as llama.cpp stores it
MOE_KEYS = {
    "qwen3moe": ("expert_count", "expert_used_count", "expert_feed_forward_length"),
    "llama": ("expert_count", "expert_used_count"),
}


def moe_file(index) -> bool:
    """A MoE model's file: qwen3moe, or Mixtral (`llama` with `llama.expert_count`)."""
    arch = index.architecture
    return arch == "qwen3moe" or (arch == "llama" and f"{arch}.expert_count" in index.scalars)


# tensor type -> the precision class `quantization="auto"` serves a file of that type in
TYPE_CLASSES = {
    "F32": "none",
    "F16": "none",
    "BF16": "none",
    "Q8_0": "int8",  # 8-bit blocks of 32 -> int8 per channel
    "Q6_K": "int8",
    "Q5_0": "int8",  # 5-bit: int4 groups would lose a bit, int8 channels keep them
    "Q5_1": "int8",
    "Q5_K": "int8",
    "Q3_K": "int8",  # signed sub-block scales: int4 groups of 32 measured 10x its error
    "Q4_0": "int4",  # codes copied: exact
    "Q4_1": "int4",
    "Q4_K": "int4",
    "Q2_K": "int4",  # 2-bit codes, 16-value sub-blocks: re-quantized into int4 groups of 32
}
_MAGIC = b"GGUF"


GGUF_HINT = (
    "give a whole GGUF v2/v3 model file as llama.cpp writes it, an HF model folder, "
    "or no model path for the embedded SmolLM2-135M-Instruct"
)


class GGUFError(ModelLoadError, ValueError):
    """A GGUF file that cannot be served: not GGUF, or an architecture / tensor type / tensor
    outside what is supported. A ValueError offline, exit 2 at a server's start."""


def is_gguf(path: str | Path) -> bool:
    """A file named `*.gguf`, or any file starting with GGUF's magic."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    with open(p, "rb") as f:
        return f.read(4) == _MAGIC


def check_gguf(path: str | Path):
    """The file's index (`quantization.gguf_index.GGUFIndex`) once it is known servable."""
    from minisgl.quantization.gguf_index import read_index

    path = Path(path)
    try:
        index = read_index(path)
    except ValueError as e:
        raise GGUFError(f"cannot read {str(path)!r} as a GGUF model: {e}; {GGUF_HINT}") from None
    arch = str(index.scalars.get("general.architecture", ""))
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    for t in index.tensors:
        kind = t.tensor_type.name
        if kind not in TYPE_CLASSES:
            raise GGUFError(
                f"{path.name}: tensor {t.name!r} has GGUF type {kind}, which is not supported; "
                f"supported: {', '.join(TYPE_CLASSES)}"
            )
        if t.name == ROPE_FREQS:  # Llama 3.1+ RoPE scaling: checked below
            continue
        _check_tensor(path, index, t)
    if moe_file(index):
        for key in MOE_KEYS[arch]:
            if not isinstance(index.scalars.get(f"{arch}.{key}"), int):
                raise GGUFError(
                    f"{path.name}: a MoE {arch} file needs the integer key {arch}.{key}"
                )
    rope_parameters(index)
    return index


def _check_tensor(path: Path, index, t) -> None:
    """GGUFError unless tensor `t` has an HF name in the file's model: a dense linear or norm,
    or in a MoE file its router and stacked experts, as many as `<arch>.expert_count`."""
    from minisgl.quantization.gguf import float_name, is_moe_tensor

    arch = index.architecture
    if not is_moe_tensor(t.name):
        known = float_name(t.name) is not None
    else:
        known = moe_file(index)
    if not known:
        raise GGUFError(
            f"{path.name}: tensor {t.name!r} is not part of a dense {arch} model "
            "(mixture-of-experts GGUF files: qwen3moe, or llama with llama.expert_count)"
        )
    if len(t.shape) == 3:
        count = index.scalars.get(f"{arch}.expert_count")
        if count != int(t.shape[-1]):
            raise GGUFError(
                f"{path.name}: tensor {t.name!r} stacks {int(t.shape[-1])} experts, but "
                f"{arch}.expert_count is {count}"
            )


def rope_parameters(index) -> dict | None:
    """HF's `llama3` rope parameters of a Llama 3.1+ file (`gguf_rope`), None without scaling;
    GGUFError naming the tensor when its values are not that scaling."""
    from minisgl.gguf_rope import rope_scaling_of

    try:
        return rope_scaling_of(index)
    except ValueError as e:
        raise GGUFError(f"{index.path.name}: tensor {ROPE_FREQS!r} {e}") from None


def native_class(index) -> str:
    """The precision class of the file's linears: that of the type holding most of their
    values (a Q4_K_M file, Q4_K with some Q6_K: int4)."""
    from minisgl.quantization.gguf import ROUTER

    sizes: dict[str, int] = {}
    for t in index.tensors:
        if t.name in ("token_embd.weight", "output.weight") or t.name.endswith(f".{ROUTER}.weight"):
            continue  # the router stays float whatever the class
        if len(t.shape) in (2, 3):  # linears, stacked experts
            n = 1
            for d in t.shape:
                n *= int(d)
            cls = TYPE_CLASSES[t.tensor_type.name]
            sizes[cls] = sizes.get(cls, 0) + n
    return max(sizes, key=lambda c: sizes[c]) if sizes else "none"


def _moe_config(config, arch: str, scalars: dict):
    """The config of a MoE file as llama.cpp runs it. qwen3moe: the expert rows from
    `expert_feed_forward_length` (transformers leaves Qwen3MoeConfig's default), every layer
    sparse, the top-k weights renormalised. `llama` with experts: a MixtralConfig of the
    transformers-read Llama config, experts `feed_forward_length` wide, no sliding window."""
    if arch == "qwen3moe":
        config.moe_intermediate_size = int(scalars[f"{arch}.expert_feed_forward_length"])
        config.mlp_only_layers, config.decoder_sparse_step = [], 1
        config.norm_topk_prob = True
        return config
    from transformers import MixtralConfig

    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "bos_token_id",
            "eos_token_id", "pad_token_id")  # fmt: skip
    fields = {k: getattr(config, k) for k in keep if getattr(config, k, None) is not None}
    return MixtralConfig(
        **fields,
        num_local_experts=int(scalars[f"{arch}.expert_count"]),
        num_experts_per_tok=int(scalars[f"{arch}.expert_used_count"]),
        sliding_window=None,
    )


def model_folder(path: str | Path) -> Path:
    """Where the file's HF folder is (or will be) converted."""
    from minisgl.utils.cache import cache_dir

    real = os.path.realpath(path)
    st = os.stat(real)
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / "gguf" / key / Path(path).stem


# a tied embedding's names: the one transformers' `save_pretrained` writes (and vLLM reads), and
# the one this project's conversions wrote alone before 2026-12-07 (and earlier versions read)
TIED_NAME, OLD_TIED_NAME = "model.embed_tokens.weight", "lm_head.weight"


def tie_names(weights: dict, tied: bool) -> None:
    """A tied model's embedding under both of its names (`weights` changed in place): a folder
    any version of minisgl, transformers and vLLM loads. 113 MB more for the embedded model's
    fp32 folder."""
    if tied and OLD_TIED_NAME not in weights:
        weights[OLD_TIED_NAME] = weights[TIED_NAME].clone()


def converted(target: Path) -> bool:
    """Whether `target` holds a finished conversion in the current layout (`packed/manifest`
    written, a tied embedding under both names)."""
    from minisgl.quantization.cache import manifest

    if not (target / "config.json").is_file() or manifest(target) is None:
        return False
    return lacks_tied_name(target) is None


def lacks_tied_name(target: Path) -> str | None:
    """The name a tied model's folder lacks for its embedding, None if neither: conversions
    wrote `lm_head.weight` alone before 2026-12-07, which vLLM misread (it used it as the
    output matrix and left the embedding at zero), then for a day `model.embed_tokens.weight`
    alone, which earlier minisgl versions cannot load quantized."""
    import json

    from safetensors import safe_open

    if not json.loads((target / "config.json").read_text()).get("tie_word_embeddings"):
        return None
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    missing = {TIED_NAME, OLD_TIED_NAME} - names
    return missing.pop() if len(missing) == 1 else None


def add_tied_name(target: Path, name: str) -> None:
    """The weights file rewritten with the tied embedding under `name` too (published by a
    rename; the caller holds the folder's lock)."""
    from safetensors.torch import load_file, save_file

    path = target / "model.safetensors"
    weights = load_file(str(path))
    other = OLD_TIED_NAME if name == TIED_NAME else TIED_NAME
    weights[name] = weights[other].clone()
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    save_file(weights, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def resolve_model_path(model_path: str | Path) -> str:
    """`model_path` itself, or for a GGUF file its converted HF folder (converting it first)."""
    if not is_gguf(model_path):
        return str(model_path)
    from minisgl.quantization.cache import manifest, write_manifest

    path = Path(model_path)
    target = model_folder(path)
    if converted(target):
        return str(target)
    index = check_gguf(path)
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "config.json").is_file():
            logger.warning("first use of %s: converting it once into %s", path.name, target)
            convert(path, target, index.scalars, rope_parameters(index))
        elif (name := lacks_tied_name(target)) is not None:
            add_tied_name(target, name)
        if manifest(target) is None:
            write_manifest(target, path.resolve(), native_class(index))
    return str(target)


def convert(
    gguf: Path, target: Path, scalars: dict | None = None, rope: dict | None = None
) -> None:
    """The GGUF as an fp32 HF folder, published by an atomic rename: config and tokenizer
    through transformers' GGUF loader, the weights through one read of our own
    (`quantization.gguf.read_gguf_float`). `scalars`: the file's scalar metadata, for the
    head size transformers leaves out (qwen3's `attention.key_length`); `rope`: the rope
    parameters read from `rope_freqs.weight` (`rope_parameters`), which transformers skips."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from minisgl.quantization.gguf import MOE_NAMES, one_parse_per_file, read_gguf_float

    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with one_parse_per_file():  # the three reads share one parse of the metadata
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        arch = str((scalars or {}).get("general.architecture", ""))
        head_dim = (scalars or {}).get(f"{arch}.attention.key_length")
        if head_dim is not None:
            config.head_dim = int(head_dim)
        if rope is not None:
            config.rope_parameters = dict(rope)
        if (scalars or {}).get(f"{arch}.expert_count") is not None:
            config = _moe_config(config, arch, scalars or {})
        moe = config.model_type if config.model_type in MOE_NAMES else None
        weights = read_gguf_float(gguf, config.num_attention_heads, config.num_key_value_heads,
                                  moe)  # fmt: skip
    tmp.mkdir(parents=True)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = torch.float32  # the weights' dtype, as the loaded model's config said
    config.save_pretrained(str(tmp))
    tie_names(weights, bool(config.tie_word_embeddings))
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(tmp))
    os.replace(tmp, target)
