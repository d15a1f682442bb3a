"""A model loaded at a precision: the float checkpoint (`models/loader.py`), then its linears
swapped for packed ones. int8 / int4 take the packed tensors from the folder's cache when it
has them (their float tensors are then not even read); w8a8 first smooths the float weights
on calibration text (`smooth.py`)."""

from __future__ import annotations

from pathlib import Path

import torch

from minisgl.config import ModelConfig, ModelLoadError
from minisgl.distributed.layout import TPInfo
from minisgl.models.loader import load_model
from minisgl.quantization.apply import quantize_model
from minisgl.quantization.cache import read_packed


def load_quantized(
    model_path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantization: str,
    dummy_weights: bool = False,
    tp: TPInfo | None = None,
) -> torch.nn.Module:
    """`load_model` at `quantization` (none, int8, int4, w8a8)."""
    if cfg.moe is not None and quantization == "w8a8":
        raise ValueError(
            "quantization='w8a8' does not cover mixture-of-experts models (its smoothing and "
            f"fused MLP are the dense MLP's); {cfg.architecture}: use 'int8' or 'int4'"
        )
    if dummy_weights and quantization != "none":
        raise ModelLoadError(f"dummy weights are float only, not quantization={quantization!r}")
    if quantization == "none":
        return load_model(model_path, cfg, dtype, device, max_positions, dummy_weights, tp)
    packed = (
        read_packed(Path(model_path), quantization) if quantization in ("int8", "int4") else None
    )
    # an untied embedding stays float (`quantize_model` packs the lm_head alone): read it
    untied_embedding = set() if cfg.tie_word_embeddings else {"model.embed_tokens.weight"}
    model = load_model(model_path, cfg, dtype, device, max_positions, tp=tp,
                       provided=frozenset(packed or ()) - untied_embedding)  # fmt: skip
    if quantization == "w8a8":
        from minisgl.quantization import smooth

        smooth.calibrate_and_smooth(model, Path(model_path), max_positions)
    quantize_model(model, cfg, quantization, dtype, packed)
    return model.eval()
