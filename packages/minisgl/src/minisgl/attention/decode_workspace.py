"""Dense per-batch K/V for consecutive decode steps of the same batch (torch-native backend,
decode through SDPA: the C kernel on a CPU reads the pool in place and keeps no workspace).

Paged KV has to be gathered into a dense [bs, KVH, L, D] block before attention. When the
batch of a decode step is the previous decode step's batch, one token longer each, the block of
the previous step plus the new token is exactly what the gather would produce: the workspace
keeps those blocks per layer and appends, instead of gathering the whole KV every step. The
pool stays the source of truth; any other step (a prefill, a finished or new request) rebuilds
the workspace from it, and a batch whose blocks exceed the byte budget is not kept at all.
"""

from __future__ import annotations

import os

import numpy as np
import torch

DEFAULT_BUDGET_MB = 512
GROW = 128  # extra positions allocated on a rebuild, so appends rarely rebuild
MIN_GROW = 16  # ... fewer where the budget is short, but not fewer than this


class DecodeWorkspace:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        mb = int(os.environ.get("MINISGL_DECODE_WORKSPACE_MB", DEFAULT_BUDGET_MB))
        self.budget = mb << 20
        self.num_layers, self.kvh, self.d = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.elt = torch.empty(0, dtype=dtype).element_size()
        # [layers, bs, KVH, capacity, D] each (one tensor: a compiled graph guards its shape
        # once, not once per layer); None while no batch is kept
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.slots: np.ndarray | None = None
        self.lens: np.ndarray | None = None
        self.rebuilds = self.appends = 0

    def invalidate(self) -> None:
        self.slots = self.lens = None

    def mode(self, slots: np.ndarray, seq_lens: np.ndarray) -> str | None:
        """`append`, `rebuild` (then filled by the layers) or None (over budget: gather; a
        batch with a slot twice, a speculative verify step: its rows' KV past their request's
        accepted length is rewritten by the next step, so nothing of it is kept)."""
        lmax = int(seq_lens.max())
        if len(np.unique(slots)) != len(slots):
            self.invalidate()
            return None
        if (
            self.slots is not None
            and np.array_equal(slots, self.slots)
            and np.array_equal(seq_lens, self.lens + 1)
            and self.k is not None
            and lmax <= self.k.shape[3]
        ):
            self.lens = seq_lens.copy()
            self.appends += 1
            return "append"
        bs = len(slots)
        fits = self.budget // (2 * self.num_layers * bs * self.kvh * self.d * self.elt)
        cap = min(lmax + GROW, fits)
        if cap < lmax + MIN_GROW:
            self.invalidate()
            self.k = self.v = None
            return None
        if self.k is None or self.k.shape[1] != bs or self.k.shape[3] < lmax + MIN_GROW:
            shape = (self.num_layers, bs, self.kvh, cap, self.d)
            self.k = self.v = None  # the old blocks go before the new ones come
            # zeros: SDPA reads every position up to the longest request, under a mask
            self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.slots, self.lens = slots.copy(), seq_lens.copy()
        self.rebuilds += 1
        return "rebuild"
