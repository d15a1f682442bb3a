"""Fused decode-layer ops in Triton: the models' CUDA path (`models/llama.py`, `fused_ops`).

Each op is one launch. They run compiled on CUDA tensors, or in Triton's interpreter on CPU
tensors when `TRITON_INTERPRET=1` was set before triton was first imported (tests). Rounding
follows the torch reference of the CPU path step by step (`models/layers.py`): values are
computed in fp32 and rounded to the model dtype wherever torch rounds, so fp32 differs from it
only by summation order and fp16 / bf16 by at most one rounding.
"""

from __future__ import annotations

from minisgl.kernels.slots import KVSlots
from minisgl.kernels.triton.activation import silu_and_mul
from minisgl.kernels.triton.argmax import argmax_rows
from minisgl.kernels.triton.moe import fused_moe
from minisgl.kernels.triton.norm import add_rms_norm_, rms_norm
from minisgl.kernels.triton.rope import rope_

__all__ = [
    "KVSlots",
    "add_rms_norm_",
    "argmax_rows",
    "fused_moe",
    "rms_norm",
    "rope_",
    "silu_and_mul",
]
