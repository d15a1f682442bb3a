"""SiLU-and-mul: the gated MLP's activation as one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.triton.rounding import bf16_rne, rounded

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(X, OUT, stride_x, stride_o, N: tl.constexpr, BLOCK: tl.constexpr,
                         BF16_RNE: tl.constexpr):  # fmt: skip
    """OUT[t, j] = silu(X[t, j]) * X[t, N + j] (silu rounded to the dtype first, as torch)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(X + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + t * stride_x + N + offs, mask=mask, other=0.0).to(tl.float32)
    dt = X.dtype.element_ty
    s = rounded(g / (1.0 + tl.exp(-g)), dt, BF16_RNE)
    tl.store(OUT + t * stride_o + offs, rounded(s * u, dt, BF16_RNE).to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
    t, two_i = x.shape
    n = two_i // 2
    assert x.stride(-1) == 1 and two_i == 2 * n
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        block = min(_BLOCK, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(t, triton.cdiv(n, block))](
            x, out, x.stride(0), out.stride(0), N=n, BLOCK=block, BF16_RNE=bf16_rne(x.dtype)
        )
    return out
