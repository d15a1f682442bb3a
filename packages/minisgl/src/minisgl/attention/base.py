from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.kernels.slots import KVSlots
from minisgl.kvcache.pool import KVPool
from minisgl.step.plan import StepPlan
from minisgl.step.staging import DevicePlan, PlanStager


@dataclass(frozen=True)
class GraphInputs:
    """The fixed device buffers a decode graph reads (int32, sized for the largest batch):
    row i of a bucket of `bs` rows is entry i; `kv_indices` holds every row's KV locations
    back to back (`kv_indptr`), padding rows included."""

    input_ids: torch.Tensor  # [max_bs]
    positions: torch.Tensor  # [max_bs]
    out_loc: torch.Tensor  # [max_bs]
    seq_lens: torch.Tensor  # [max_bs]
    kv_indptr: torch.Tensor  # [max_bs + 1]
    kv_indices: torch.Tensor  # [kv capacity]
    max_seq_len: int


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged KV pool.

    `prepare` turns a StepPlan (and its staged device copy) into backend metadata once per
    step; `forward` is called by every layer with that metadata. The backend writes the new
    K/V to the pool itself. A backend that can run decode steps from a CUDA graph implements
    `graph_prepare`: device ops only, fixed shapes for a batch size.
    """

    graph_friendly = False  # `--graph-runner auto` captures graphs only for such backends

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
    def prepare(self, plan: StepPlan, dev: DevicePlan | None = None) -> Any:
        """`dev`: the plan staged on the device (`step/staging.py`); staged here if None."""

    def stage(self, plan: StepPlan) -> DevicePlan:
        """The plan on the device, for callers that did not stage it (tests, tools)."""
        return PlanStager(self.device, capacity=1).stage(plan)

    def graph_prepare(self, inputs: GraphInputs, bs: int) -> Any:
        """Metadata of a decode step of `bs` rows read from `inputs`, computed by device ops
        only (run inside the captured region, every replay)."""
        raise NotImplementedError(f"{type(self).__name__} cannot run decode graphs")

    def compiles(self, meta: Any) -> bool:
        """Whether a decode step with this metadata runs through the compiled forward
        (`engine/compiled.py`); the shapes the engine compiles at start must cover it."""
        return True

    def graph_key(self, meta: Any) -> Hashable:
        """What a decode step's compiled graph depends on beyond its shapes (a branch taken on
        the metadata): steps with different keys get graphs with dynamo caches of their own,
        so a step checks the guards of one graph only."""
        return None

    def before_replay(self) -> None:  # noqa: B027 (optional hook, nothing to do by default)
        """Called on the host before a graph step replaces an eager decode step."""

    def kv_slots(self, layer: int, meta: Any) -> KVSlots | None:
        """Where `layer`'s new K/V rows go, for a caller that writes them itself (the fused
        RoPE) and then calls `forward(..., stored=True)`; None: `forward` stores them."""
        return None

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: Any,
        stored: bool = False,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] -> [T, H * D]. `stored`: k and v are already in the
        pool at `kv_slots(layer, meta)`."""
