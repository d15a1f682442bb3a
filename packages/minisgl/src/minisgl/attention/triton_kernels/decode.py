"""Paged decode attention: one query token per request, split-KV, GQA-aware.

Stage 1 runs one program per (request, KV head, split): the `gqa` query heads sharing a KV
head are one [BLOCK_H, D] tile, so each K/V row is loaded once for the whole group. A request's
KV range (its sliding window, if any) is cut into `num_splits` pieces of whole BLOCK_N blocks;
each program writes a partial output and its log-sum-exp (base 2; -inf for an empty piece).
Stage 2 merges the pieces per (request, head). With one split (large batches: the grid fills the
GPU without splitting) the partial output is the output: stage 1 writes it and stage 2 is not
launched. The grid depends only on the batch size and
`num_splits` (never on sequence lengths, which are read on the device), so a decode step can be
captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.attention.triton_kernels import dot_args, load_kv_rows, softmax_step

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    Q, K_CACHE, V_CACHE, KV_INDPTR, KV_INDICES, SEQ_LENS, MID_O, MID_LSE, OUT,
    stride_qt, stride_qh, stride_ct, stride_ch, stride_ot, stride_oh,
    scale_log2, window,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b)
    kv_base = tl.load(KV_INDPTR + b).to(tl.int64)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + split * split_len
    s_hi = tl.minimum(s_lo + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GQA
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GQA + offs_h
    q_ptr = Q + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(s_lo, s_hi, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < s_hi
        k, v = load_kv_rows(K_CACHE, V_CACHE, KV_INDICES, kv_base, pos, n_mask, kvh, stride_ct,
                            stride_ch, offs_d, d_mask)  # fmt: skip
        m_i, l_i, acc = softmax_step(q, k, v, n_mask[None, :], m_i, l_i, acc, scale_log2,
                                     PRECISION, UPCAST)  # fmt: skip

    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:  # the merge of one split is the identity (its weight exp2(0) = 1)
        dst = OUT + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, out.to(OUT.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        mid_row = (b.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(MID_O + mid_row[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=h_mask[:, None] & d_mask[None, :])  # fmt: skip
        tl.store(MID_LSE + mid_row, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(
    MID_O, MID_LSE, OUT,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    base = (b.to(tl.int64) * NUM_HEADS + h) * NUM_SPLITS
    lse = tl.load(MID_LSE + base + offs_s, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # empty splits (-inf) weigh 0
    o = tl.load(MID_O + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    dst = OUT + b.to(tl.int64) * stride_ot + h * stride_oh + offs_d
    tl.store(dst, out.to(OUT.dtype.element_ty), mask=d_mask)


@dataclass(frozen=True)
class DecodeBuffers:
    """Scratch of the split stage: partial outputs and their log-sum-exps (fp32)."""

    o: torch.Tensor  # [bs, H, splits, D]
    lse: torch.Tensor  # [bs, H, splits]

    @property
    def num_splits(self) -> int:
        return self.o.shape[2]

    @staticmethod
    def numel(bs: int, num_heads: int, num_splits: int, head_dim: int) -> int:
        return bs * num_heads * num_splits * (head_dim + 1)

    @classmethod
    def carve(cls, scratch: torch.Tensor, bs: int, num_heads: int, num_splits: int,
              head_dim: int) -> DecodeBuffers:  # fmt: skip
        """Views at the start of a flat fp32 `scratch` of at least `numel(...)` elements."""
        n = bs * num_heads * num_splits
        o = scratch[: n * head_dim].view(bs, num_heads, num_splits, head_dim)
        return cls(o, scratch[n * head_dim : n * (head_dim + 1)].view(bs, num_heads, num_splits))

    @classmethod
    def empty(cls, bs: int, num_heads: int, num_splits: int, head_dim: int,
              device: torch.device | str) -> DecodeBuffers:  # fmt: skip
        size = cls.numel(bs, num_heads, num_splits, head_dim)
        scratch = torch.empty(size, dtype=torch.float32, device=device)
        return cls.carve(scratch, bs, num_heads, num_splits, head_dim)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    buffers: DecodeBuffers,
    out: torch.Tensor,
    sliding_window: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """out[b, h] = softmax(q[b, h] . K_b / sqrt(D)) V_b over request b's KV (its window).

    q: [bs, H, D]; caches: [N, KVH, D]; request b's KV locations are
    kv_indices[kv_indptr[b] : kv_indptr[b] + seq_lens[b]]; out: [bs, H, D].
    """
    bs, num_heads, d = q.shape
    kvh = k_cache.shape[1]
    gqa = num_heads // kvh
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert out.is_contiguous() or out.stride(-1) == 1
    splits = buffers.num_splits
    block_d = max(16, triton.next_power_of_2(d))
    _decode_split_kernel[(bs, kvh, splits)](
        q, k_cache, v_cache, kv_indptr, kv_indices, seq_lens, buffers.o, buffers.lse, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0),
        out.stride(1),
        LOG2E / math.sqrt(d), sliding_window or 0,
        GQA=gqa, HEAD_DIM=d, NUM_HEADS=num_heads, NUM_SPLITS=splits,
        HAS_WINDOW=sliding_window is not None,
        BLOCK_H=max(16, triton.next_power_of_2(gqa)), BLOCK_D=block_d, BLOCK_N=block_n,
        num_warps=num_warps, **dot_args(q.dtype),
    )  # fmt: skip
    if splits == 1:
        return out
    _decode_reduce_kernel[(bs, num_heads)](
        buffers.o, buffers.lse, out,
        out.stride(0), out.stride(1),
        HEAD_DIM=d, NUM_HEADS=num_heads, NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
    )  # fmt: skip
    return out
