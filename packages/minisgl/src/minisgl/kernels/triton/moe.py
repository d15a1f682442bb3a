"""Fused mixture-of-experts MLP: the experts of a MoE block as two grouped-GEMM launches.

`moe_align` sorts a step's (token, expert) pairs by expert and pads each expert's run to a
multiple of BLOCK_M (device ops only: no host read, so a decode step stays capturable); every
BLOCK_M rows of the sorted list then belong to one expert. `fused_moe` runs:

1. the gate/up GEMM: each block's rows (tokens gathered from x) times its expert's `[2I, H]`
   matrix, stored at the pair's row of a `[T * k, 2I]` buffer (rounded to the model dtype, as
   the torch path's `F.linear`);
2. SiLU x up (`silu_and_mul`);
3. the down GEMM of those rows times the expert's `[H, I]` matrix, scaled in fp32 by the pair's
   routing weight, into an fp32 `[T * k, H]` buffer, summed over each token's k rows and
   rounded once to the model dtype.

fp32 operands multiply in IEEE fp32 (no TF32); in Triton's interpreter bf16 operands are widened
to fp32 first (its bf16 `tl.dot` is wrong in triton 3.9; the products are exact either way) and
the bf16 stores rounded on the bits (`rounding.py`: the interpreter truncates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.triton.activation import silu_and_mul
from minisgl.kernels.triton.rounding import bf16_rne, rounded

_INTERPRETED = bool(triton.knobs.runtime.interpret)
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _moe_gemm_kernel(A, B, C, W, PAIRS, BLOCK_EXPERT, num_pairs, N, K, stride_am, stride_be,
                     stride_bn, stride_bk, stride_cm, ROW_DIV: tl.constexpr,
                     MUL_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                     BF16_RNE: tl.constexpr):  # fmt: skip
    """C[pair, n] = A[pair // ROW_DIV] . B[expert, n] (times W[pair] if MUL_W) for the BLOCK_M
    sorted pairs of program 0's block (its expert: BLOCK_EXPERT; -1: padding, nothing)."""
    pid_m = tl.program_id(0)
    e = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    if e >= 0:
        pair = tl.load(PAIRS + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = pair < num_pairs
        row = pair // ROW_DIV
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            a = tl.load(A + row[:, None] * stride_am + offs_k[None, :],
                        mask=valid[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
            b = tl.load(B + e * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # fmt: skip
            if UPCAST:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
            else:
                acc += tl.dot(a, b, input_precision=PRECISION)
        if MUL_W:
            acc = acc * tl.load(W + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
        dt = C.dtype.element_ty
        tl.store(C + pair[:, None] * stride_cm + offs_n[None, :],
                 rounded(acc, dt, BF16_RNE).to(dt), mask=valid[:, None] & n_mask[None, :])  # fmt: skip


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows a program multiplies: 16 while the experts get few rows each (decode), else 64."""
    return 16 if num_pairs < 16 * num_experts else 64


def moe_align(
    experts: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [L], block_expert [L / block_m]) of expert ids [T, k]: the flat pair indices
    (t * k + j) sorted by expert, each expert's run padded to a multiple of block_m with the
    value T * k; the expert of each block, -1 past the last. L bounds the padded length from the
    shapes alone (T * k + E * (block_m - 1), rounded up), so nothing is read on the host."""
    flat = experts.reshape(-1)
    n, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_e]
    length = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    pairs = torch.full((length,), n, dtype=torch.int32, device=dev)
    pairs[(ends - padded)[sorted_e] + rank] = order.to(torch.int32)
    starts = torch.arange(0, length, block_m, device=dev)
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return pairs, block_expert


def _gemm(a, b, c, w, pairs, block_expert, num_pairs, row_div, block_m) -> None:
    """c[pairs] = a[pairs // row_div] @ b[expert]^T (x w): b [E, N, K]."""
    n, k = b.shape[1], b.shape[2]
    upcast = _INTERPRETED and a.dtype == torch.bfloat16
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _moe_gemm_kernel[grid](
        a, b, c, w, pairs, block_expert, num_pairs, n, k, a.stride(0), b.stride(0), b.stride(1),
        b.stride(2), c.stride(0), ROW_DIV=row_div, MUL_W=w is not None, BLOCK_M=block_m,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if a.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
        BF16_RNE=bf16_rne(c.dtype),
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
) -> torch.Tensor:
    """Sum over each token's top-k experts of weight x expert(x): x [T, H], gate_up [E, 2I, H]
    (gate rows, then up rows), down [E, H, I], weights and experts [T, k]."""
    t, k = experts.shape
    num_experts, two_i, h = gate_up.shape
    assert x.stride(-1) == 1 and gate_up.stride(-1) == 1 and down.stride(-1) == 1
    if t == 0:
        return torch.zeros_like(x)
    num_pairs = t * k
    block_m = block_m_for(num_pairs, num_experts)
    pairs, block_expert = moe_align(experts, num_experts, block_m)
    gate_up_out = torch.empty((num_pairs, two_i), dtype=x.dtype, device=x.device)
    _gemm(x, gate_up, gate_up_out, None, pairs, block_expert, num_pairs, k, block_m)
    act = silu_and_mul(gate_up_out)
    out = torch.empty((num_pairs, h), dtype=torch.float32, device=x.device)
    w = weights.reshape(-1).contiguous()
    _gemm(act, down, out, w, pairs, block_expert, num_pairs, 1, block_m)
    return out.view(t, k, h).sum(dim=1).to(x.dtype)
