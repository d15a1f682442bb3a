"""The int8 GEMM and the whole-model decode step of w8a8 models in C (`decode_step_w8a8.c`) over
`W8A8Linear`'s weights: the tensors they read (`Int8Panels`, `LayerWeights`) and their calls."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from minisgl.kernels.cpu import _ERRORS, _library, step_layers
from minisgl.kernels.cpu.int4 import Dims

PANEL = 16  # output channels a panel (`PANEL`)
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Mat(ctypes.Structure):
    _fields_ = [("panels", _PTR), ("comp", _PTR), ("scales", _PTR), ("bias", _PTR),
                ("n", _I64), ("k", _I64)]  # fmt: skip


LAYER_RECORD = step_layers.layer_record(_Mat)  # `step_layers.layer_structs`' record
LayerWeights = step_layers.LayerWeights  # of Int8Panels matrices


@dataclass(frozen=True)
class Int8Panels:
    """An int8 matrix [N, K] (per output channel scales) as the C GEMM reads it: panels of 16
    channels, int8 [ceil(N / 16), K / 4, 16, 4] (channel j's columns 4c..4c+3 together), the
    zero-point term of u8 activations comp int32 = 128 * each channel's sum of weights, fp32
    scales (both padded to the panels with zeros), an optional bf16 bias [N]."""

    panels: torch.Tensor
    comp: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None
    n: int
    k: int

    @classmethod
    def of(cls, qweight: torch.Tensor, scales: torch.Tensor,
           bias: torch.Tensor | None) -> Int8Panels:  # fmt: skip
        """From `W8A8Linear`'s qweight int8 [N, K] (K % 4 == 0) and scales [N]."""
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.shape[1] % 4:
            raise ValueError(f"Int8Panels: qweight {tuple(qweight.shape)} {qweight.dtype} is not "
                             "int8 [N, K] with K a multiple of 4")  # fmt: skip
        n, k = qweight.shape
        if scales.numel() != n or (bias is not None and bias.numel() != n):
            raise ValueError(f"Int8Panels: {n} channels, {scales.numel()} scales, "
                             f"{None if bias is None else bias.numel()} biases")  # fmt: skip
        n16 = -(-n // PANEL) * PANEL
        w = torch.zeros(n16, k, dtype=torch.int8)
        w[:n] = qweight
        panels = w.view(n16 // PANEL, PANEL, k // 4, 4).transpose(1, 2).contiguous()
        comp = torch.zeros(n16, dtype=torch.int32)
        comp[:n] = qweight.to(torch.int32).sum(dim=1) * 128
        sc = torch.zeros(n16, dtype=torch.float32)
        sc[:n] = scales.reshape(-1).float()
        if bias is not None:
            bias = bias.to(torch.bfloat16).contiguous()
        return cls(panels, comp, sc, bias, n, k)

    def struct(self) -> _Mat:
        return _Mat(self.panels.data_ptr(), self.comp.data_ptr(), self.scales.data_ptr(),
                    step_layers.ptr(self.bias), self.n, self.k)  # fmt: skip


def int8_gemm(xq: torch.Tensor, w: Int8Panels) -> torch.Tensor:
    """int8 xq [rows, K] (rows >= 1, each contiguous) times w^T: bf16 [rows, N], each output
    bf16(float(the exact int32 sum) * its channel's scale), the modules' `w8a8.int8_gemm` in
    bf16 (no bias); ValueError on other shapes."""
    lib = _library()
    assert lib is not None
    if xq.dtype != torch.int8 or xq.dim() != 2 or xq.shape[1] != w.k or xq.stride(1) != 1:
        raise ValueError(f"int8_gemm: xq {tuple(xq.shape)} {xq.dtype} for a [{w.n}, {w.k}] "
                         "matrix")  # fmt: skip
    rows = xq.shape[0]
    if rows < 1:
        raise ValueError(f"int8_gemm: rows must be >= 1, got {rows}")
    out = torch.empty(rows, w.n, dtype=torch.bfloat16)
    rc = lib.w8a8_gemm_bf16(xq.data_ptr(), xq.stride(0), w.panels.data_ptr(), w.comp.data_ptr(),
                            w.scales.data_ptr(), out.data_ptr(), rows, w.n, w.k,
                            torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise ValueError(f"int8_gemm: {_ERRORS.get(rc, rc)}")
    return out


@dataclass(frozen=True)
class HeadPanels:
    """A weight-only int8 matrix [N, K] (the lm_head: bf16 activations) as the C head reads it:
    its int8 weights widened to bf16 (exact) in panels of 16 channels, [ceil(N / 16), K / 2,
    16, 2] (channel j's columns 2c, 2c + 1 together), fp32 scales padded to the panels."""

    panels: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int

    @classmethod
    def of(cls, qweight: torch.Tensor, scales: torch.Tensor) -> HeadPanels:
        """From `Int8Linear`'s qweight int8 [N, K] (K even) and scales [N]."""
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.shape[1] % 2:
            raise ValueError(f"HeadPanels: qweight {tuple(qweight.shape)} {qweight.dtype} is not "
                             "int8 [N, K] with K even")  # fmt: skip
        n, k = qweight.shape
        if scales.numel() != n:
            raise ValueError(f"HeadPanels: {n} channels, {scales.numel()} scales")
        n16 = -(-n // PANEL) * PANEL
        w = torch.zeros(n16, k, dtype=torch.bfloat16)
        w[:n] = qweight
        panels = w.view(n16 // PANEL, PANEL, k // 2, 2).transpose(1, 2).contiguous()
        sc = torch.zeros(n16, dtype=torch.float32)
        sc[:n] = scales.reshape(-1).float()
        return cls(panels, sc, n, k)


def int8_head(x: torch.Tensor, w: HeadPanels) -> torch.Tensor:
    """bf16 x [rows, K] (rows >= 1, each contiguous) times w^T: bf16 [rows, N], each output
    bf16(the fp32 sum of exact products * its scale); ValueError on other shapes."""
    lib = _library()
    assert lib is not None
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != w.k or x.stride(1) != 1:
        raise ValueError(f"int8_head: x {tuple(x.shape)} {x.dtype} for a [{w.n}, {w.k}] matrix")
    if x.shape[0] < 1:
        raise ValueError(f"int8_head: rows must be >= 1, got {x.shape[0]}")
    out = torch.empty(x.shape[0], w.n, dtype=torch.bfloat16)
    rc = lib.int8_head_bf16(x.data_ptr(), x.stride(0), w.panels.data_ptr(), w.scales.data_ptr(),
                            out.data_ptr(), x.shape[0], w.n, w.k, torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise ValueError(f"int8_head: {_ERRORS.get(rc, rc)}")
    return out


def decode_layers(
    structs: ctypes.Array,
    dims: Dims,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_loc: torch.Tensor,
    kv_index: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    pool_rows: int,
    row_stride: int,
    window: int,
) -> None:
    """Every decoder layer of a decode step (`decode_step_w8a8.c`): x bf16 [rows, hidden] (the
    tokens' embeddings, contiguous) is updated in place to the residual stream after the last
    layer, as the modules compute it. cos / sin bf16 [rows, head_dim] at the tokens' positions;
    K / V of token m go to pool row out_loc[m]; request m attends pool rows
    kv_index[kv_indptr[m] + l], l < kv_lens[m] (int64)."""
    lib = _library()
    assert lib is not None and x.is_contiguous() and x.dtype == torch.bfloat16
    rc = lib.decode_layers_w8a8_bf16(
        ctypes.addressof(structs), len(structs), x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        out_loc.data_ptr(), kv_index.data_ptr(), kv_index.numel(), kv_indptr.data_ptr(),
        kv_lens.data_ptr(), x.shape[0], dims.hidden, dims.num_heads, dims.num_kv_heads,
        dims.head_dim, dims.intermediate, pool_rows, row_stride, window, dims.eps,
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"decode_layers_w8a8: {_ERRORS.get(rc, rc)}")
