"""Triton attention over the paged KV pool (CUDA; on CPU only under TRITON_INTERPRET=1, for tests).

Per layer: one fused KV store kernel (or none: the fused RoPE wrote K/V, `kv_slots`), then either the split-KV decode kernels (a decode step:
one token per request, grid fixed by the batch size) or one varlen extend launch (prefill,
chunked prefill, prefix hits). The pool is addressed through the plan's token-level
`kv_indices`, so every page size works the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minisgl.attention import register_backend
from minisgl.attention.base import AttentionBackend, GraphInputs
from minisgl.attention.triton_kernels import INTERPRETED
from minisgl.attention.triton_kernels.decode import DecodeBuffers, decode_attention
from minisgl.attention.triton_kernels.extend import extend_attention, extend_blocks
from minisgl.attention.triton_kernels.kv_store import store_kv
from minisgl.kernels.slots import KVSlots
from minisgl.step.plan import StepPlan
from minisgl.step.staging import DevicePlan

# Split-KV target: about this many decode programs per streaming multiprocessor.
_PROGRAMS_PER_SM = 2
# The decode split kernel's (BLOCK_N, num_warps); None: (the backend's block_n, 4). A tuning
# knob that `benchmark.decode_step --decode-tiles` sweeps.
_DECODE_TILE: tuple[int, int] | None = None
MAX_KV_SPLITS = 16
CPU_KV_SPLITS = 2  # the interpreter runs programs one by one: few splits, still merged


@dataclass
class TritonMeta:
    out_loc: torch.Tensor  # [T] pool location of each fed token
    kv_indptr: torch.Tensor  # [bs + 1]
    kv_indices: torch.Tensor  # [sum(seq_lens)]
    seq_lens: torch.Tensor  # [bs]
    decode: DecodeBuffers | None  # set for a decode step (one token per request)
    # extend: query offsets per request and the (request, offset) of every query block
    q_indptr: torch.Tensor | None = None
    block_req: torch.Tensor | None = None
    block_start: torch.Tensor | None = None


@register_backend("triton")
class TritonBackend(AttentionBackend):
    graph_friendly = True  # decode grid and reads bounded by each request's own length

    def __init__(
        self,
        *args,
        max_kv_splits: int | None = None,
        block_m: int | None = None,
        block_n: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.device.type != "cuda" and not INTERPRETED:
            raise RuntimeError(
                f"the triton attention backend needs a CUDA device (got {self.device}); on CPU "
                "it runs only in Triton's interpreter: set TRITON_INTERPRET=1 before minisgl "
                "imports triton (slow: for tests), or use --attention-backend torch_native"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads not a multiple of {self.num_kv_heads}")
        wide = self.pool.k[0].element_size() <= 2 and self.head_dim <= 128
        self.block_m = block_m or (64 if wide else 32)
        self.block_n = block_n or (64 if wide else 32)
        self.decode_tile = _DECODE_TILE or (self.block_n, 4)
        if self.device.type == "cuda":
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.max_kv_splits = max_kv_splits or MAX_KV_SPLITS
            self.target_programs = _PROGRAMS_PER_SM * sms
        else:
            self.max_kv_splits = max_kv_splits or CPU_KV_SPLITS
            self.target_programs = 0  # always max_kv_splits
        # split-stage scratch of every batch size: views at the start of one flat buffer, which
        # only grows (capturing the largest batch first keeps all addresses stable)
        self._scratch = torch.empty(0, dtype=torch.float32, device=self.device)
        self._retired: list[torch.Tensor] = []

    def num_kv_splits(self, bs: int) -> int:
        """Splits per (request, KV head) of a decode step: a function of the batch size only."""
        per_split = bs * self.num_kv_heads
        want = -(-self.target_programs // per_split) if self.target_programs else self.max_kv_splits
        return max(1, min(self.max_kv_splits, want))

    def decode_buffers(self, bs: int) -> DecodeBuffers:
        """Split-stage scratch of a decode step of `bs` requests."""
        dims = (bs, self.num_heads, self.num_kv_splits(bs), self.head_dim)
        need = DecodeBuffers.numel(*dims)
        if self._scratch.numel() < need:
            # a captured graph may still point into the old buffer: keep it alive
            self._retired.append(self._scratch)
            self._scratch = torch.empty(need, dtype=torch.float32, device=self.device)
        return DecodeBuffers.carve(self._scratch, *dims)

    def prepare(self, plan: StepPlan, staged: DevicePlan | None = None) -> TritonMeta:
        staged = staged or self.stage(plan)
        meta = TritonMeta(
            out_loc=staged.out_loc,
            kv_indptr=staged.kv_indptr,
            kv_indices=staged.kv_indices,
            seq_lens=staged.seq_lens,
            decode=None,
        )
        bs = plan.batch_size
        if not plan.is_prefill and plan.num_tokens == bs:
            meta.decode = self.decode_buffers(bs)
            return meta
        q_indptr = np.zeros(bs + 1, dtype=np.int32)
        np.cumsum(plan.extend_lens, out=q_indptr[1:])
        block_req, block_start = extend_blocks(plan.extend_lens, self.block_m)
        meta.q_indptr = self._dev(q_indptr)
        meta.block_req = self._dev(block_req)
        meta.block_start = self._dev(block_start)
        return meta

    def graph_prepare(self, inputs: GraphInputs, bs: int) -> TritonMeta:
        """The decode kernels read per-request ranges of the fixed buffers; their grid and
        split scratch depend on `bs` only (capture the largest batch first: see `_scratch`)."""
        return TritonMeta(
            out_loc=inputs.out_loc[:bs],
            kv_indptr=inputs.kv_indptr[: bs + 1],
            kv_indices=inputs.kv_indices,
            seq_lens=inputs.seq_lens[:bs],
            decode=self.decode_buffers(bs),
        )

    def kv_slots(self, layer: int, meta: TritonMeta) -> KVSlots:
        return KVSlots(self.pool.k[layer], self.pool.v[layer], meta.out_loc)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: TritonMeta,
        stored: bool = False,
    ) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        if not stored:
            store_kv(k, v, k_cache, v_cache, meta.out_loc)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.decode is not None:
            decode_attention(q, k_cache, v_cache, meta.kv_indptr, meta.kv_indices, meta.seq_lens,
                             meta.decode, out, self.sliding_window, *self.decode_tile)  # fmt: skip
        else:
            assert meta.q_indptr is not None and meta.block_req is not None
            assert meta.block_start is not None
            extend_attention(q, k_cache, v_cache, meta.q_indptr, meta.kv_indptr, meta.kv_indices,
                             meta.seq_lens, meta.block_req, meta.block_start, out,
                             self.sliding_window, self.block_m, self.block_n)  # fmt: skip
        return out.view(q.shape[0], -1)

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(self.device)
