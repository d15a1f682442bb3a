"""Triton kernels of the triton attention backend: KV store, paged decode, varlen extend.

They run compiled on CUDA tensors, or in Triton's interpreter on CPU tensors (for tests on a
machine without a GPU) when `TRITON_INTERPRET=1` is set before triton is first imported:
triton 3.x reads it when `triton.jit` decorates a function, its own `tl.cdiv`, `tl.max`, ...
included, so setting it later has no effect. `INTERPRETED` records the mode of this process.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)


def dot_args(dtype: torch.dtype) -> dict[str, object]:
    """Constexprs of `mma` for operands of `dtype`: fp32 in IEEE fp32 (no TF32), so it matches
    the fp32 reference; bf16 upcast to fp32 in the interpreter, whose tl.dot of bf16 operands
    is wrong in triton 3.9 (the products are exact in fp32, as in a bf16 MMA with fp32
    accumulation)."""
    upcast = INTERPRETED and dtype == torch.bfloat16
    return dict(PRECISION="ieee" if dtype == torch.float32 or upcast else "tf32", UPCAST=upcast)


@triton.jit
def mma(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def load_kv_rows(K_CACHE, V_CACHE, KV_INDICES, kv_base, pos, n_mask, kvh, stride_ct, stride_ch,
                 offs_d, d_mask):  # fmt: skip
    """K and V rows [BLOCK_N, BLOCK_D] of KV positions `pos` (masked rows: 0) of one KV head."""
    loc = tl.load(KV_INDICES + kv_base + pos, mask=n_mask, other=0).to(tl.int64)
    row = loc[:, None] * stride_ct + kvh * stride_ch + offs_d[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(K_CACHE + row, mask=kv_mask, other=0.0)
    v = tl.load(V_CACHE + row, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):  # fmt: skip
    """One online-softmax step (base 2) of rows q over a KV block; `visible` masks scores."""
    s = mma(q, tl.trans(k), PRECISION, UPCAST) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l_i, acc
