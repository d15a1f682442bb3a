"""RoPE applied in place to q and k (one launch for both), Qwen3's q/k RMSNorm fused in, and
optionally the attention backend's KV store: the rotated k and v written to the pool rows of
the step (`KVSlots`), so no separate store launch follows.

The tables are `RotaryEmbedding`'s: cos and a sin carrying rotate_half's sign (-sin on the
first half), [max_positions, D], read at each token's position (no per-step gather)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.slots import KVSlots
from minisgl.kernels.triton.rounding import bf16_rne, rounded


@triton.jit
def _rotate_heads(X, stride_h, c1, c2, s1, s2, W, eps, offs, d_mask, NUM_HEADS: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, QK_NORM: tl.constexpr,
                  RNE: tl.constexpr, COPY, copy_stride_h, STORE_COPY: tl.constexpr):  # fmt: skip
    """The heads [NUM_HEADS, 2 * HALF] at X: (RMSNorm * W, then) x * cos + swap(x) * sin;
    with STORE_COPY also written to the heads at COPY (a pool row)."""
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
    o1 = rounded(o1, dt, RNE).to(dt)
    o2 = rounded(o2, dt, RNE).to(dt)
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)
    if STORE_COPY:
        c = COPY + heads[:, None] * copy_stride_h + offs[None, :]
        tl.store(c, o1.to(COPY.dtype.element_ty), mask=mask)
        tl.store(c + HALF, o2.to(COPY.dtype.element_ty), mask=mask)


@triton.jit
def _copy_heads(X, stride_h, DST, dst_stride_h, NUM_HEADS: tl.constexpr, D: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """The heads [NUM_HEADS, D] at X copied to DST (v into its pool row)."""
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_HEADS) & (offs[None, :] < D)
    x = tl.load(X + heads[:, None] * stride_h + offs[None, :], mask=mask)
    tl.store(DST + heads[:, None] * dst_stride_h + offs[None, :], x.to(DST.dtype.element_ty),
             mask=mask)  # fmt: skip


@triton.jit
def _rope_kernel(
    Q, K, COS, SIN, POS, QW, KW, V, K_CACHE, V_CACHE, OUT_LOC,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_c, eps,
    stride_vt, stride_vh, stride_ct, stride_ch,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HALF: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_HALF: tl.constexpr,
    QK_NORM: tl.constexpr, BF16_RNE: tl.constexpr, STORE_KV: tl.constexpr,
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
                  NUM_Q, HALF, BLOCK_Q, QK_NORM, BF16_RNE, Q, 0, False)  # fmt: skip
    if STORE_KV:
        loc = tl.load(OUT_LOC + t).to(tl.int64)
        _rotate_heads(K + t * stride_kt, stride_kh, c1, c2, s1, s2, KW, eps, offs, d_mask,
                      NUM_K, HALF, BLOCK_K, QK_NORM, BF16_RNE, K_CACHE + loc * stride_ct,
                      stride_ch, True)  # fmt: skip
        _copy_heads(V + t * stride_vt, stride_vh, V_CACHE + loc * stride_ct, stride_ch,
                    NUM_K, 2 * HALF, BLOCK_K, 2 * BLOCK_HALF)  # fmt: skip
    else:
        _rotate_heads(K + t * stride_kt, stride_kh, c1, c2, s1, s2, KW, eps, offs, d_mask,
                      NUM_K, HALF, BLOCK_K, QK_NORM, BF16_RNE, K, 0, False)  # fmt: skip


def rope_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    v: torch.Tensor | None = None,
    cache: KVSlots | None = None,
) -> None:
    """In place: q [T, H, D] and k [T, KVH, D] (strided views of a fused QKV output are fine)
    rotated at `positions` [T]; with `q_norm` and `k_norm` ([D] weights) each head is first
    RMSNormed (Qwen3). cos and sin: [max_positions, D] tables in q's dtype. With `cache`, the
    rotated k and `v` [T, KVH, D] are also written to the pool rows `cache.out_loc`."""
    t, h, d = q.shape
    kvh = k.shape[1]
    assert k.shape[0] == t and k.shape[2] == d and d % 2 == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride() == sin.stride()
    assert cos.stride(-1) == 1 and cos.shape[-1] == d
    assert (q_norm is None) == (k_norm is None)
    if cache is not None:  # the KV store of this step's rows, in the same launch
        kc, vc = cache.k_cache, cache.v_cache
        assert v is not None and v.shape == k.shape and v.stride(-1) == 1
        assert kc.stride() == vc.stride() and kc.stride(-1) == 1 and kc.shape[1:] == (kvh, d)
        store = (v, kc, vc, cache.out_loc, v.stride(0), v.stride(1), kc.stride(0), kc.stride(1))
    else:
        store = (k, k, k, positions, 0, 0, 0, 0)  # unused: STORE_KV is off
    if t == 0:
        return
    half = d // 2
    qk_norm = q_norm is not None
    _rope_kernel[(t,)](
        q, k, cos, sin, positions, q_norm if qk_norm else cos, k_norm if qk_norm else cos,
        *store[:4],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), eps, *store[4:],
        NUM_Q=h, NUM_K=kvh, HALF=half,
        BLOCK_Q=triton.next_power_of_2(h), BLOCK_K=triton.next_power_of_2(kvh),
        BLOCK_HALF=triton.next_power_of_2(half), QK_NORM=qk_norm,
        BF16_RNE=bf16_rne(q.dtype), STORE_KV=cache is not None,
        enable_fp_fusion=False,  # no FMA: products rounded as torch's separate mul and add
    )  # fmt: skip
