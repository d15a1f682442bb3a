"""Varlen extend (prefill) attention over a cached paged prefix plus the new causal tokens.

One launch for all requests of a step: the grid is (query block, head), where the query blocks
of every request are listed on the host (`extend_blocks`, from the plan's numpy arrays: no
device sync). Request r feeds tokens at positions [seq_len - ext, seq_len); its K/V, prefix and
new tokens alike, are read from the pool through `kv_indices` (the KV store runs first). Each
block walks only the KV range its rows can see: causal, and the sliding window if any.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from minisgl.attention.triton_kernels import dot_args, load_kv_rows, softmax_step
from minisgl.attention.triton_kernels.decode import LOG2E


@triton.jit
def _extend_kernel(
    Q, K_CACHE, V_CACHE, OUT, Q_INDPTR, KV_INDPTR, KV_INDICES, SEQ_LENS, BLOCK_REQ, BLOCK_START,
    stride_qt, stride_qh, stride_ct, stride_ch, stride_ot, stride_oh,
    scale_log2, window,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GQA
    req = tl.load(BLOCK_REQ + blk)
    m0 = tl.load(BLOCK_START + blk)
    q_start = tl.load(Q_INDPTR + req)
    ext = tl.load(Q_INDPTR + req + 1) - q_start
    seq_len = tl.load(SEQ_LENS + req)
    prefix = seq_len - ext
    kv_base = tl.load(KV_INDPTR + req).to(tl.int64)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < ext
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip

    hi = tl.minimum(prefix + m0 + BLOCK_M, seq_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix + m0 - window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kv_pos = start + offs_n
        n_mask = kv_pos < hi
        k, v = load_kv_rows(K_CACHE, V_CACHE, KV_INDICES, kv_base, kv_pos, n_mask, kvh,
                            stride_ct, stride_ch, offs_d, d_mask)  # fmt: skip
        visible = n_mask[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, PRECISION,
                                     UPCAST)  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = OUT + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(dst, out.to(OUT.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def extend_blocks(extend_lens: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """(request, first query offset) of every BLOCK_M query block of the step (host arrays)."""
    ext = np.asarray(extend_lens, dtype=np.int64)
    n_blocks = (ext + block_m - 1) // block_m
    req = np.repeat(np.arange(len(ext), dtype=np.int32), n_blocks)
    first = np.zeros(len(ext) + 1, dtype=np.int64)
    np.cumsum(n_blocks, out=first[1:])
    start = (np.arange(int(first[-1]), dtype=np.int64) - first[req]) * block_m
    return req, start.astype(np.int32)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    block_req: torch.Tensor,
    block_start: torch.Tensor,
    out: torch.Tensor,
    sliding_window: int | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole KV (prefix + new).

    q: [T, H, D] (request r's rows are q_indptr[r] : q_indptr[r + 1]); caches: [N, KVH, D];
    block_req / block_start: from `extend_blocks(extend_lens, block_m)`; out: [T, H, D].
    """
    t, num_heads, d = q.shape
    n_blocks = block_req.shape[0]
    if t == 0 or n_blocks == 0:
        return out
    gqa = num_heads // k_cache.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    _extend_kernel[(n_blocks, num_heads)](
        q, k_cache, v_cache, out, q_indptr, kv_indptr, kv_indices, seq_lens, block_req, block_start,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        LOG2E / math.sqrt(d), sliding_window or 0,
        GQA=gqa, HEAD_DIM=d, HAS_WINDOW=sliding_window is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
        **dot_args(q.dtype),
    )  # fmt: skip
    return out
