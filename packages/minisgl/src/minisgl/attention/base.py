from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from minisgl.kvcache.pool import KVPool
from minisgl.scheduler.plan import StepPlan


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged KV pool.

    `prepare` turns a StepPlan into backend metadata once per step; `forward` is called by
    every layer with that metadata. The backend writes the new K/V to the pool itself.
    """

    def __init__(
        self,
        pool: KVPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None,
        device: torch.device,
    ) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.device = device

    @abstractmethod
    def prepare(self, plan: StepPlan) -> Any: ...

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] -> [T, H * D]."""
