"""One fused kernel writing the step's new K and V rows into the pool at `out_loc`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K, V, K_CACHE, V_CACHE, OUT_LOC,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ct, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    loc = tl.load(OUT_LOC + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(K + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = loc * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(K_CACHE + dst, k, mask=mask)
    tl.store(V_CACHE + dst, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
) -> None:
    """k_cache[out_loc] = k; v_cache[out_loc] = v. k/v: [T, KVH, D], caches: [N, KVH, D]."""
    t, kvh, d = k.shape
    if t == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, out_loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        NUM_KV_HEADS=kvh, HEAD_DIM=d,
        BLOCK_H=triton.next_power_of_2(kvh), BLOCK_D=triton.next_power_of_2(d),
    )  # fmt: skip


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
