"""Build a model on the target device and fill it from safetensors, one tensor at a time, or
with deterministic random weights (`--dummy-weights`: a folder with only config.json)."""

from __future__ import annotations

import json
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch

from minisgl.config import ModelConfig, ModelLoadError
from minisgl.models import MODEL_REGISTRY
from minisgl.models.llama import STACKED_PARAMS, shard_sizes
from minisgl.utils.log import get_logger

logger = get_logger(__name__)


def weight_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_path / n for n in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"weight shards listed in {index.name} are missing: {missing}")
        return files
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in model directory {str(model_path)!r}")
    return files


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


DUMMY_SEED = 0
DUMMY_STD = 0.02  # HF's default initializer_range


def _build(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int):
    """The model with uninitialised parameters on `device` (RoPE tables computed, ties set)."""
    cls = MODEL_REGISTRY[cfg.architecture]
    with _default_dtype(dtype), torch.device("meta"):
        model = cls(cfg, max_positions)
    model = model.to_empty(device=device)
    # the RoPE tables are computed, not loaded: rebuild them on the device
    with _default_dtype(dtype), torch.device(device):
        model.rotary = type(model.rotary)(cfg, max_positions, dtype)
    model.tie_weights()
    return model


def fill_dummy_weights(model: torch.nn.Module, cfg: ModelConfig, seed: int = DUMMY_SEED) -> None:
    """Random weights of the right shapes: norms 1, biases 0, every other tensor
    N(0, initializer_range), drawn on the CPU from a generator seeded by (seed, parameter
    name), so a parameter's values do not depend on the device, the dtype or the depth."""
    std = float(getattr(cfg.hf_config, "initializer_range", None) or DUMMY_STD)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied parameters once
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
                param.copy_(values)


def load_model(
    model_path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantization: str = "none",
    dummy_weights: bool = False,
):
    """Build the model and fill it from safetensors. Checkpoint q/k/v and gate/up projections
    land in row slices of the fused `qkv_proj` / `gate_up_proj`. With `quantization` int8 or
    int4 the linears are then swapped for packed ones, taken from the folder's packed cache
    when it has them (their float tensors are then not even read). `dummy_weights`: no
    checkpoint is read, see `fill_dummy_weights`."""
    if dummy_weights:
        if quantization != "none":
            raise ModelLoadError(f"dummy weights are float only, not quantization={quantization!r}")
        model = _build(cfg, dtype, device, max_positions)
        fill_dummy_weights(model, cfg)
        logger.info("dummy weights for %s (seed %d)", cfg.architecture, DUMMY_SEED)
        return model.eval()
    from safetensors import safe_open

    from minisgl.quantization.cache import read_packed

    model_path = Path(model_path)
    files = weight_files(model_path)
    packed = read_packed(model_path, quantization) if quantization in ("int8", "int4") else None
    model = _build(cfg, dtype, device, max_positions)
    targets = _load_targets(model, cfg)
    pending = set(targets) - set(packed or ())
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                target = targets.get(name)
                if target is None:
                    logger.debug("ignoring checkpoint tensor %s", name)
                    continue
                if name not in pending:  # packed, or a tied alias already loaded
                    continue
                param, rows = target
                tensor = f.get_tensor(name)
                dest = param if rows is None else param[rows[0] : rows[1]]
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ModelLoadError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}"
                    )
                with torch.no_grad():
                    dest.copy_(tensor)
                pending -= {n for n, t in targets.items() if t[0] is param and t[1] == rows}
    if pending:
        raise ModelLoadError(f"missing weights in {str(model_path)!r}: {sorted(pending)[:8]}")
    if quantization == "w8a8":  # smoothed from the float weights (`quantization/smooth.py`)
        from minisgl.quantization import smooth

        smooth.calibrate_and_smooth(model, model_path, max_positions)
    if quantization != "none":
        from minisgl.quantization.apply import quantize_model

        quantize_model(model, cfg, quantization, dtype, packed)
    return model.eval()


def _load_targets(
    model: torch.nn.Module, cfg: ModelConfig
) -> dict[str, tuple[torch.nn.Parameter, tuple[int, int] | None]]:
    """Checkpoint name -> (parameter, row slice of a fused parameter or None)."""
    targets: dict[str, tuple[torch.nn.Parameter, tuple[int, int] | None]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        parts = name.rsplit(".", 2)
        prefix, leaf, kind = parts if len(parts) == 3 else ("", "", "")
        shards = [(n, i) for n, (f, i) in STACKED_PARAMS.items() if f == leaf]
        if not shards:
            targets[name] = (param, None)
            continue
        sizes = shard_sizes(cfg, leaf)
        for shard, i in shards:
            start = sum(sizes[:i])
            targets[f"{prefix}.{shard}.{kind}"] = (param, (start, start + sizes[i]))
    return targets
