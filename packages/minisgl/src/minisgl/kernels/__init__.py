"""Kernels that layers above share (a leaf package: it imports nothing of minisgl's but
`utils`).

`kernels.triton`: the fused decode-layer ops of the models' CUDA path (RMSNorm with the
residual add, RoPE in place, SiLU-and-mul). Triton is imported only when that subpackage is.
`kernels.cpu`: the C kernels of the CPU path (attention, KV store, quantized GEMVs and
de-quantization, the sampler's argmax, the one-call decode step).
"""

from __future__ import annotations

import importlib
import os

import torch

FUSED_OPS_ENV = "MINISGL_FUSED_OPS"  # auto (default) / on / off


def resolve_fused_ops(device: torch.device, compiled: bool) -> tuple[bool, str]:
    """(whether the models run the fused Triton ops, why). `auto`: on a CUDA device when
    triton imports and the forward is not `torch.compile`d (inductor fuses those ops itself);
    `on` forces them (on a CPU only in Triton's interpreter: tests); `off` keeps the torch ops."""
    mode = os.environ.get(FUSED_OPS_ENV, "auto")
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"{FUSED_OPS_ENV} must be auto, on or off, got {mode!r}")
    if mode == "off":
        return False, f"{FUSED_OPS_ENV}=off"
    if compiled:
        return False, "enable_torch_compile: inductor fuses the layer's small ops"
    if mode == "auto" and device.type != "cuda":
        return False, f"device is {device.type}: the torch ops"
    try:
        importlib.import_module("minisgl.kernels.triton")
    except ImportError as e:
        if mode == "on":
            raise
        return False, f"triton does not import: {type(e).__name__}: {e}"
    if mode == "on":
        from minisgl.kernels.triton.rounding import INTERPRETED

        if device.type != "cuda" and not INTERPRETED:
            raise RuntimeError(f"{FUSED_OPS_ENV}=on on {device.type} needs TRITON_INTERPRET=1 "
                               "set before triton is first imported")  # fmt: skip
        return True, f"{FUSED_OPS_ENV}=on"
    return True, "CUDA device and triton imports"
