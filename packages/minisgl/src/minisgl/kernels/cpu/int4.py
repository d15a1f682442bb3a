"""The int4 GEMV and the whole-model decode step in C (`decode_step.c`) over `Int4Linear`'s
codes: the tensors they read (`Int4Matrix`, `LayerWeights`) and their calls."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from minisgl.kernels.cpu import _ERRORS, _library, step_layers

GROUP = 32  # columns a scale and zero cover (`INT4_GROUP`)
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Mat(ctypes.Structure):
    _fields_ = [("codes", _PTR), ("sz", _PTR), ("bias", _PTR),
                ("n", _I64), ("k", _I64), ("gp", _I64)]  # fmt: skip


LAYER_RECORD = step_layers.layer_record(_Mat)  # `step_layers.layer_structs`' record
LayerWeights = step_layers.LayerWeights  # of Int4Matrix matrices


@dataclass(frozen=True)
class Int4Matrix:
    """An int4 matrix as the C GEMV reads it: codes uint8 [N, K / 2] (low nibble the even
    column), bf16 scales and zeros interleaved [N, gp, 2] (gp: the K / 32 groups rounded up to
    4, zeros after), an optional bf16 bias [N]. Weights (code - 8) * scale + zero, as
    `Int4Linear`'s."""

    codes: torch.Tensor
    scales_zeros: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def of(cls, codes: torch.Tensor, scales_zeros: torch.Tensor,
           bias: torch.Tensor | None) -> Int4Matrix:  # fmt: skip
        """From `Int4Linear`'s codes [N, K / 2] and scales_zeros [K / 32, N, 2] (bf16)."""
        n, half = codes.shape
        groups = scales_zeros.shape[0]
        if (codes.dtype != torch.uint8 or scales_zeros.dtype != torch.bfloat16
                or 2 * half != groups * GROUP or scales_zeros.shape[1:] != (n, 2)):  # fmt: skip
            raise ValueError(f"Int4Matrix: codes {tuple(codes.shape)} {codes.dtype} and scales "
                             f"{tuple(scales_zeros.shape)} {scales_zeros.dtype} do not match")  # fmt: skip
        gp = -(-groups // 4) * 4
        sz = torch.zeros(n, gp, 2, dtype=torch.bfloat16)
        sz[:, :groups] = scales_zeros.transpose(0, 1)
        if bias is not None:
            bias = bias.to(torch.bfloat16).contiguous()
        return cls(codes.contiguous(), sz, bias)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2

    def struct(self) -> _Mat:
        n, k = self.shape
        sz = self.scales_zeros
        return _Mat(
            self.codes.data_ptr(),
            sz.data_ptr(),
            step_layers.ptr(self.bias),
            n,
            k,
            sz.shape[1],
        )


def int4_gemv(x: torch.Tensor, w: Int4Matrix, invariant: bool = False) -> torch.Tensor:
    """bf16 x [rows, K] (rows >= 1, each contiguous) times w^T (+ bias): bf16 [rows, N]. x is
    quantized per group of 32 to int8 (decode_step.c), so the result is not the packed torch
    kernel's to the bit; ValueError on other shapes. A row's bits do not depend on the other
    rows from 2 rows on; `invariant` (deterministic mode): one row alone too (it runs the
    multi-row tiles instead of the single-stream kernel)."""
    lib = _library()
    assert lib is not None
    n, k = w.shape
    rows = x.shape[0] if x.dim() == 2 else 0
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"int4_gemv: x {tuple(x.shape)} {x.dtype} for a [{n}, {k}] matrix")
    if rows < 1:
        raise ValueError(f"int4_gemv: rows must be >= 1, got {rows}")
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    sz = w.scales_zeros  # the lm_head's call, every decode step: no ctypes record built
    rc = lib.int4_gemv_bf16(x.data_ptr(), x.stride(0), w.codes.data_ptr(), sz.data_ptr(),
                            step_layers.ptr(w.bias), out.data_ptr(), rows, n, k, sz.shape[1],
                            torch.get_num_threads(), int(invariant))  # fmt: skip
    if rc != 0:
        raise ValueError(f"int4_gemv: {_ERRORS.get(rc, rc)}")
    return out


@dataclass(frozen=True)
class Dims:
    """A model's decode dimensions as `decode_layers` checks them."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


def decode_layers(
    structs: ctypes.Array,
    dims: Dims,
    x: torch.Tensor,
    final_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_loc: torch.Tensor,
    kv_index: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    pool_rows: int,
    row_stride: int,
    window: int,
    invariant: bool = False,
) -> torch.Tensor:
    """Every decoder layer of a decode step and the final norm (`decode_step.c`): x bf16
    [rows, hidden] (the tokens' embeddings, contiguous) is updated in place to the residual
    stream after the last layer; returns its final RMSNorm [rows, hidden]. cos / sin bf16
    [rows, head_dim] at the tokens' positions; K / V of token m go to pool row out_loc[m];
    request m attends pool rows kv_index[kv_indptr[m] + l], l < kv_lens[m] (int64).
    `invariant`: a row's bits do not depend on the number of rows (`int4_gemv`'s)."""
    lib = _library()
    assert lib is not None and x.is_contiguous() and x.dtype == torch.bfloat16
    rows = x.shape[0]
    out = torch.empty_like(x)
    rc = lib.decode_layers_bf16(
        ctypes.addressof(structs), len(structs), x.data_ptr(), final_norm.data_ptr(),
        out.data_ptr(), cos.data_ptr(), sin.data_ptr(), out_loc.data_ptr(), kv_index.data_ptr(),
        kv_index.numel(), kv_indptr.data_ptr(), kv_lens.data_ptr(), rows, dims.hidden,
        dims.num_heads, dims.num_kv_heads, dims.head_dim, dims.intermediate, pool_rows,
        row_stride, window, dims.eps, torch.get_num_threads(), int(invariant),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"decode_layers: {_ERRORS.get(rc, rc)}")
    return out
