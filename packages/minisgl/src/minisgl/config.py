"""Frozen configuration: what the engine was asked to run, and what the model is."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)


GRAPH_RUNNERS = ("auto", "cuda", "replay", "none")  # see engine/graph_runner.py
# `auto`: the model file's precision class (the packed cache of `default_model.py`), else none
QUANTIZATION_METHODS = ("auto", "none", "int8", "int4", "w8a8")


class ModelLoadError(RuntimeError):
    """The model directory cannot be served (missing files, unknown architecture...)."""


# what to do instead, said by every error about a model path that is no model folder
MODEL_PATH_HINT = (
    "give an HF model folder (config.json, the tokenizer's files and *.safetensors weights), "
    "or no model path for the embedded SmolLM2-135M-Instruct"
)


def _not_a_folder(path: Path) -> str:
    if not path.exists():
        what = "it does not exist"
    elif path.suffix.lower() == ".gguf":
        what = (
            "it is a GGUF file; GGUF files are not loaded (the embedded model's alone, "
            "converted once into an HF folder)"
        )
    else:
        what = "it is a file"
    return f"model path {str(path)!r} is not a directory: {what}; {MODEL_PATH_HINT}"


def weight_files(model_path: Path) -> list[Path]:
    """The folder's safetensors files (those its index lists, else every one), each one's
    header read: a ModelLoadError names a missing or unreadable file before any loads."""
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"cannot read the weight index {str(index)!r}: {e}") from e
        files = [model_path / n for n in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"weight shards listed in {index.name} are missing: {missing}")
    else:
        files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in model directory {str(model_path)!r}")
    for f in files:
        _check_safetensors(f)
    return files


def _check_safetensors(file: Path) -> None:
    """Its header (8 bytes of length, then a JSON object) is readable: a file that is no
    safetensors file is a ModelLoadError naming it, not the loader's error deep inside."""
    try:
        with open(file, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                raise ValueError(f"its header says {n} bytes, the file has {size}")
            if not isinstance(json.loads(f.read(n)), dict):
                raise ValueError("its header is no JSON object")
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"weights file {str(file)!r} is not a readable safetensors file ({e}); "
            f"{MODEL_PATH_HINT}"
        ) from e


def check_model_dir(model_path: str | Path, weights: bool = True) -> ModelConfig:
    """What an engine reads first, checked before anything loads (the server's start-up):
    the folder, its config.json, and with `weights` its safetensors files' headers."""
    cfg = ModelConfig.from_dir(model_path)
    if weights:
        weight_files(Path(model_path))
    return cfg


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts model's MLP: `num_experts` experts of `intermediate_size` rows, the
    router's `top_k`, renormalised over the top-k when `norm_topk_prob`; the MLP of the layers in
    `sparse_layers` is a MoE block, the others' a dense MLP of `ModelConfig.intermediate_size`."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]

    @staticmethod
    def of(arch: str, hf: dict[str, Any]) -> MoEConfig | None:
        """Read as transformers' Qwen3MoeConfig / MixtralConfig do; None: a dense model."""
        layers = range(hf["num_hidden_layers"])
        if arch == "MixtralForCausalLM":
            return MoEConfig(hf["num_local_experts"], hf["num_experts_per_tok"],
                             hf["intermediate_size"], True, tuple(layers))  # fmt: skip
        if arch != "Qwen3MoeForCausalLM":
            return None
        experts = hf.get("num_experts", hf.get("num_local_experts", 128))
        step, dense = hf["decoder_sparse_step"], set(hf["mlp_only_layers"] or ())
        sparse = tuple(i for i in layers if i not in dense and experts > 0 and (i + 1) % step == 0)
        return MoEConfig(experts, hf["num_experts_per_tok"], hf["moe_intermediate_size"],
                         bool(hf["norm_topk_prob"]), sparse)  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    initializer_range: float  # the std of dummy weights
    rope_type: str  # "default": inverse frequencies from rope_theta; else transformers' init
    rope_theta: float
    model_path: str  # where transformers reads the config of a non-default RoPE
    moe: MoEConfig | None = None  # mixture-of-experts models' MLP (None: dense)

    @staticmethod
    def from_dir(model_path: str | Path) -> ModelConfig:
        """Read config.json as transformers does (its defaults for the keys left out), without
        transformers: its config classes import ~3 s of modules an engine does not use."""
        path = Path(model_path)
        cfg_file = path / "config.json"
        if not path.is_dir():
            raise ModelLoadError(_not_a_folder(path))
        if not cfg_file.is_file():
            raise ModelLoadError(
                f"no config.json in model directory {str(path)!r}; {MODEL_PATH_HINT}"
            )
        try:
            raw = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {str(cfg_file)!r}: {e}") from e
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{str(cfg_file)!r} is not a JSON object")
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or raw.get('model_type')!r} in {cfg_file}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hf = {**_HF_DEFAULTS, **_HF_ARCH_DEFAULTS[arch], **raw}
        heads = hf["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = None
        if arch in ("MistralForCausalLM", "MixtralForCausalLM") or hf.get("use_sliding_window"):
            window = hf.get("sliding_window")
        rope_type, theta = _rope_of({**_ROPE_DEFAULTS.get(arch, {}), **raw})
        return ModelConfig(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf["num_key_value_heads"] or heads,
            head_dim=hf["head_dim"] or hf["hidden_size"] // heads,
            rms_norm_eps=hf["rms_norm_eps"],
            max_position_embeddings=hf["max_position_embeddings"],
            tie_word_embeddings=bool(hf["tie_word_embeddings"]),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(hf["attention_bias"]),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=window,
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            initializer_range=float(hf["initializer_range"]),
            rope_type=rope_type,
            rope_theta=theta,
            model_path=str(path),
            moe=MoEConfig.of(arch, hf),
        )


# transformers' (5.x) defaults for the keys a config.json leaves out, as its config classes set
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,  # None: as many as the query heads
    "head_dim": None,  # None: hidden_size // num_attention_heads
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "initializer_range": 0.02,
}
_QWEN_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "intermediate_size": 22016,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,  # used only with use_sliding_window
}
_HF_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {},
    "Qwen2ForCausalLM": _QWEN_DEFAULTS,
    "Qwen3ForCausalLM": {**_QWEN_DEFAULTS, "head_dim": 128},
    "MistralForCausalLM": {
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
    },
}
_HF_ARCH_DEFAULTS["Qwen3MoeForCausalLM"] = {
    **_QWEN_DEFAULTS,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_key_value_heads": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "num_experts_per_tok": 8,  # num_experts: 128, read in MoEConfig.of (two key names)
}
_HF_ARCH_DEFAULTS["MixtralForCausalLM"] = {
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "sliding_window": None,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
_ROPE_DEFAULTS: dict[str, dict[str, Any]] = {"MixtralForCausalLM": {"rope_theta": 1e6}}
DEFAULT_ROPE_THETA = 10000.0


def _rope_of(raw: dict[str, Any]) -> tuple[str, float]:
    """(rope_type, rope_theta): transformers 5's `rope_parameters`, or the older `rope_scaling`
    with a top-level `rope_theta`."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    theta = params.get("rope_theta") or raw.get("rope_theta") or scaling.get("rope_theta")
    return rope_type or "default", float(theta or DEFAULT_ROPE_THETA)


@dataclass(frozen=True)
class SimDevice:
    """The simulated device (`--sim-device`, `engine/sim.py`): one step takes
    `base_ms + token_ms * num_tokens` ms."""

    base_ms: float = 0.5
    token_ms: float = 0.002

    @staticmethod
    def parse(spec: str) -> SimDevice:
        """`"0.5,0.002"` (ms per step, ms per token), `"0.5"` (base only) or `"default"`."""
        text = spec.strip()
        if text in ("", "default"):
            return SimDevice()
        parts = text.split(",")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if not 1 <= len(values) <= 2 or any(not v >= 0 or v == float("inf") for v in values):
            raise ValueError(
                f"--sim-device {spec!r}: expected BASE_MS[,TOKEN_MS] (finite, >= 0), e.g. 0.5,0.002"
            )
        return SimDevice(*values)

    def step_s(self, num_tokens: int) -> float:
        return (self.base_ms + self.token_ms * num_tokens) / 1000.0

    def spec(self) -> str:
        return f"{self.base_ms:g},{self.token_ms:g}"


@dataclass(frozen=True)
class EngineConfig:
    """What `LLM(...)` and the server were asked for. GPU-only options are kept and ignored on CPU."""

    model_path: str
    dtype: str = "auto"
    device: str = "auto"
    max_seq_len_override: int | None = None
    max_extend_tokens: int = 4096
    max_running_requests: int = 256
    cuda_graph_max_bs: int | None = None  # None: the default on CUDA (engine/graph_runner.py)
    graph_runner: str = "auto"  # auto (cuda on CUDA) / cuda / replay (the CPU stand-in) / none
    dummy_weights: bool = False  # random weights of the config's shapes, no checkpoint read
    page_size: int = 1
    num_pages: int | None = None
    memory_ratio: float | None = None
    cache_type: str = "radix"
    attention_backend: str = "auto"  # triton (+ CUDA graphs) on CUDA, torch_native elsewhere
    # auto (the file's precision class on CPU) / none / int8 / int4 / w8a8 (CPU only)
    quantization: str = "auto"
    sim_device: str | None = None  # "BASE_MS,TOKEN_MS": no model, see engine/sim.py
    enable_torch_compile: bool = False  # decode steps through torch.compile (engine/compiled.py)
    # batch-invariant kernels: a request's logits do not depend on the other rows of its steps
    # (CPU, bfloat16 only: `engine/deterministic.py`)
    deterministic: bool = False
    threads: int | None = None  # torch + tokenizer threads, set by make_engine (None: as is)
    tp_size: int = 1  # tensor-parallel ranks, one process each (`minisgl.distributed`)

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_extend_tokens < 1:
            raise ValueError(f"max_extend_tokens must be >= 1, got {self.max_extend_tokens}")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.cache_type not in ("radix", "naive"):
            raise ValueError(f"cache_type must be 'radix' or 'naive', got {self.cache_type!r}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.memory_ratio is not None and not (0.0 < self.memory_ratio <= 1.0):
            raise ValueError(f"memory_ratio must be in (0, 1], got {self.memory_ratio}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto/float32/float16/bfloat16, got {self.dtype!r}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be {'/'.join(QUANTIZATION_METHODS)}, got {self.quantization!r}"
            )
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0, got {self.cuda_graph_max_bs}")
        if self.graph_runner not in GRAPH_RUNNERS:
            raise ValueError(
                f"graph_runner must be one of {GRAPH_RUNNERS}, got {self.graph_runner!r}"
            )
        if self.sim_device is not None:
            SimDevice.parse(self.sim_device)  # a bad spec fails here, with the flag's syntax
