"""RMSNorm as one launch: alone, after the residual add (in place), or over gathered rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.triton.rounding import bf16_rne, rounded


@triton.jit
def _rms_norm_kernel(
    X, R, W, OUT, ROWS,
    stride_x, stride_r, stride_o, eps,
    N: tl.constexpr, BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr, HAS_ROWS: tl.constexpr,
    BF16_RNE: tl.constexpr,
):  # fmt: skip
    """OUT[i] = RMSNorm(X[r] (+ R[r])) * W, r = ROWS[i] or i; R[r] = the sum if STORE_RESIDUAL."""
    i = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(ROWS + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt = X.dtype.element_ty
    a = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        a = rounded(a + r, dt, BF16_RNE)  # torch's add in the model dtype
        if STORE_RESIDUAL:
            tl.store(R + row * stride_r + offs, a.to(dt), mask=mask)
    rstd = tl.rsqrt(tl.sum(a * a, 0) / N + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    y = rounded(w * rounded(a * rstd, dt, BF16_RNE), dt, BF16_RNE)  # normed, rounded, weighted
    tl.store(OUT + i.to(tl.int64) * stride_o + offs, y.to(dt), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            out: torch.Tensor, rows: torch.Tensor | None, eps: float, store: bool) -> None:  # fmt: skip
    n = x.shape[-1]
    assert x.dim() == 2 and x.stride(-1) == 1 and out.stride(-1) == 1 and weight.is_contiguous()
    assert residual is None or (residual.shape == x.shape and residual.stride(-1) == 1)
    if out.shape[0] == 0:
        return
    block = triton.next_power_of_2(n)
    res = x if residual is None else residual
    _rms_norm_kernel[(out.shape[0],)](
        x, res, weight, out, x if rows is None else rows,
        x.stride(0), res.stride(0), out.stride(0), eps,
        N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, STORE_RESIDUAL=store,
        HAS_ROWS=rows is not None, BF16_RNE=bf16_rne(x.dtype),
        num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm(x + residual)[rows] * weight, a new [len(rows) or T, N] tensor; x and residual
    ([T, N]) are left as they are. The first layer's input norm, and the model's final norm of
    the sampled rows."""
    out = torch.empty((x.shape[0] if rows is None else rows.shape[0], x.shape[-1]),
                      dtype=x.dtype, device=x.device)  # fmt: skip
    _launch(x, residual, weight, out, rows, eps, store=False)
    return out


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: residual += x; x = RMSNorm(residual) * weight (both [T, N])."""
    _launch(x, residual, weight, x, None, eps, store=True)
