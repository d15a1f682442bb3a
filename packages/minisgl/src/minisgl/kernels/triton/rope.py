"""RoPE applied in place to q and k (one launch for both), Qwen3's q/k RMSNorm fused in.

The tables are `RotaryEmbedding`'s: cos and a sin carrying rotate_half's sign (-sin on the
first half), [max_positions, D], read at each token's position (no per-step gather)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.triton.rounding import bf16_rne, rounded


@triton.jit
def _rotate_heads(X, stride_h, c1, c2, s1, s2, W, eps, offs, d_mask, NUM_HEADS: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, QK_NORM: tl.constexpr,
                  RNE: tl.constexpr):  # fmt: skip
    """The heads [NUM_HEADS, 2 * HALF] at X: (RMSNorm * W, then) x * cos + swap(x) * sin."""
    dt = X.dtype.element_ty
    heads = tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < NUM_HEADS) & d_mask[None, :]
    p1 = X + heads[:, None] * stride_h + offs[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        w1 = tl.load(W + offs, mask=d_mask, other=0.0).to(tl.float32)
        w2 = tl.load(W + HALF + offs, mask=d_mask, other=0.0).to(tl.float32)
        x1 = rounded(w1[None, :] * rounded(x1 * rstd[:, None], dt, RNE), dt, RNE)
        x2 = rounded(w2[None, :] * rounded(x2 * rstd[:, None], dt, RNE), dt, RNE)
    # each product rounded to the dtype, then the sum (torch's q * cos + swap(q) * sin)
    o1 = rounded(x1 * c1[None, :], dt, RNE) + rounded(x2 * s1[None, :], dt, RNE)
    o2 = rounded(x2 * c2[None, :], dt, RNE) + rounded(x1 * s2[None, :], dt, RNE)
    tl.store(p1, rounded(o1, dt, RNE).to(dt), mask=mask)
    tl.store(p1 + HALF, rounded(o2, dt, RNE).to(dt), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, COS, SIN, POS, QW, KW,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_c, eps,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HALF: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_HALF: tl.constexpr,
    QK_NORM: tl.constexpr, BF16_RNE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    d_mask = offs < HALF
    row = pos * stride_c + offs
    c1 = tl.load(COS + row, mask=d_mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + row + HALF, mask=d_mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + row, mask=d_mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + row + HALF, mask=d_mask, other=0.0).to(tl.float32)
    _rotate_heads(Q + t * stride_qt, stride_qh, c1, c2, s1, s2, QW, eps, offs, d_mask,
                  NUM_Q, HALF, BLOCK_Q, QK_NORM, BF16_RNE)  # fmt: skip
    _rotate_heads(K + t * stride_kt, stride_kh, c1, c2, s1, s2, KW, eps, offs, d_mask,
                  NUM_K, HALF, BLOCK_K, QK_NORM, BF16_RNE)  # fmt: skip


def rope_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """In place: q [T, H, D] and k [T, KVH, D] (strided views of a fused QKV output are fine)
    rotated at `positions` [T]; with `q_norm` and `k_norm` ([D] weights) each head is first
    RMSNormed (Qwen3). cos and sin: [max_positions, D] tables in q's dtype."""
    t, h, d = q.shape
    kvh = k.shape[1]
    assert k.shape[0] == t and k.shape[2] == d and d % 2 == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride() == sin.stride()
    assert cos.stride(-1) == 1 and cos.shape[-1] == d
    assert (q_norm is None) == (k_norm is None)
    if t == 0:
        return
    half = d // 2
    qk_norm = q_norm is not None
    _rope_kernel[(t,)](
        q, k, cos, sin, positions, q_norm if qk_norm else cos, k_norm if qk_norm else cos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), eps,
        NUM_Q=h, NUM_K=kvh, HALF=half,
        BLOCK_Q=triton.next_power_of_2(h), BLOCK_K=triton.next_power_of_2(kvh),
        BLOCK_HALF=triton.next_power_of_2(half), QK_NORM=qk_norm,
        BF16_RNE=bf16_rne(q.dtype),
        enable_fp_fusion=False,  # no FMA: products rounded as torch's separate mul and add
    )  # fmt: skip
