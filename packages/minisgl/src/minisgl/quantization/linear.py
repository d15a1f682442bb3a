"""Weight-only quantized layers on PyTorch's packed CPU kernels.

`_weight_int8pack_mm` (int8 per channel) and `_weight_int4pack_mm_for_cpu` (int4 per group of
32) read the packed weights as they are and de-quantize in registers; both want their scales in
the activation dtype, and both are fast with bf16 activations only (fp32 activations take a
scalar fallback, measured 10-30x slower: see docs/runtime.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.quantization import INT4_GROUP
from minisgl.quantization.packed import Int4Weight, Int8Weight


class Int8Linear(nn.Module):
    def __init__(self, w: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = w.q.shape
        self.register_buffer("qweight", w.q.contiguous())
        self.register_buffer("scales", w.scale.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(
            _rows(x, self.scales.dtype), self.qweight, self.scales
        )
        return _out(y, self.bias, x)


class Int4Linear(nn.Module):
    def __init__(self, w: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features = w.q.shape[0]
        self.in_features = w.q.shape[1] * 2
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes().contiguous(), 1)
        sz = torch.stack((w.scale.t(), w.zero.t()), dim=-1)  # [K / group, N, 2]
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_zeros", sz.to(dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = _rows(x, self.scales_zeros.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.qweight, INT4_GROUP, self.scales_zeros
        )
        return _out(y, self.bias, x)


# decode runs ~120 of these per token: skip the no-op reshape / casts (each a dispatch)
def _rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a 2-D [rows, in_features] matrix in the kernel's activation dtype."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    return x if x.dtype == dtype else x.to(dtype)


def _out(y: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The kernel's [rows, out] result (+ bias) in x's leading shape and dtype."""
    if bias is not None:
        y += bias
    if x.dim() != 2:
        y = y.view(*x.shape[:-1], y.shape[-1])
    return y if y.dtype == x.dtype else y.to(x.dtype)


class Int8Embedding(nn.Module):
    """Token embedding read from int8 rows (the tied lm_head's weights): row * its scale."""

    def __init__(self, head: Int8Linear) -> None:
        super().__init__()
        self.register_buffer("qweight", head.qweight)  # the same tensors, not copies
        self.register_buffer("scales", head.scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.qweight).to(self.scales.dtype)
        return rows * self.scales[ids][:, None]


def int4_supported(out_features: int, in_features: int) -> bool:
    return in_features % INT4_GROUP == 0 and out_features % 8 == 0
