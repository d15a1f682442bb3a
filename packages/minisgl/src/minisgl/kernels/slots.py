"""Where a layer's new K and V rows go in the pool: the contract between an attention backend
and a kernel that writes them (the fused RoPE of `kernels.triton`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSlots:
    """`k_cache[out_loc[t]]` and `v_cache[out_loc[t]]` receive token t's K and V ([N, KVH, D]
    pool tensors of one layer, last dimension contiguous; out_loc [T] int)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    out_loc: torch.Tensor
