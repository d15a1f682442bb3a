"""Rounding to the model dtype inside the fused kernels, the same in the interpreter as on a GPU.

Triton 3.9's interpreter converts fp32 to bf16 by truncation (`fp_downcast_rounding="rtne"`
included); a GPU rounds to nearest even, as torch does. Under the interpreter bf16 is
therefore rounded on the bits (`BF16_RNE`), so the CPU tests check the GPU's numbers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)


def bf16_rne(dtype: torch.dtype) -> bool:
    """The `BF16_RNE` constexpr of a kernel whose model dtype is `dtype`."""
    return INTERPRETED and dtype == torch.bfloat16


@triton.jit
def rounded(x, DT: tl.constexpr, BF16_RNE: tl.constexpr):
    """fp32 `x` rounded to DT (to nearest even), returned as fp32."""
    if BF16_RNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)
