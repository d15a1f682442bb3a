"""Build a model on the target device and fill it from safetensors, one tensor at a time."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from minisgl.config import ModelConfig, ModelLoadError
from minisgl.models import MODEL_REGISTRY
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


def load_model(
    model_path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
):
    from safetensors import safe_open

    model_path = Path(model_path)
    files = weight_files(model_path)
    cls = MODEL_REGISTRY[cfg.architecture]
    with _default_dtype(dtype), torch.device("meta"):
        model = cls(cfg, max_positions)
    model = model.to_empty(device=device)
    # the RoPE tables are computed, not loaded: rebuild them on the device
    with _default_dtype(dtype), torch.device(device):
        model.rotary = type(model.rotary)(cfg, max_positions, dtype)
    model.tie_weights()
    params = dict(model.named_parameters(remove_duplicate=False))
    pending = set(params)
    aliases: dict[int, set[str]] = {}  # tied weights: one tensor, several names
    for name, param in params.items():
        aliases.setdefault(id(param), set()).add(name)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                param = params.get(name)
                if param is None:
                    logger.debug("ignoring checkpoint tensor %s", name)
                    continue
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ModelLoadError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.copy_(tensor)
                pending -= aliases[id(param)]
    if pending:
        raise ModelLoadError(f"missing weights in {str(model_path)!r}: {sorted(pending)[:8]}")
    return model.eval()
