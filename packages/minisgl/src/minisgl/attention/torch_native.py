"""Torch-native attention over the paged KV pool (CPU and CUDA; the reference backend)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from minisgl.attention import register_backend
from minisgl.attention.base import AttentionBackend, GraphInputs
from minisgl.attention.decode_workspace import DecodeWorkspace
from minisgl.kernels import cpu as cpu_native
from minisgl.step.plan import StepPlan
from minisgl.step.staging import DevicePlan


@dataclass
class _PrefillGroup:
    """Requests of one prefill step attended by one SDPA call, padded to [B, Lq, Lkv]."""

    q_index: torch.Tensor  # [B, Lq] rows of the step's q (padding repeats a request's last row)
    kv_index: torch.Tensor  # [B, Lkv] pool locations (padding repeats the last location)
    mask: torch.Tensor  # [B, 1, Lq, Lkv] bool: causal (+ sliding window) and length mask
    out_index: torch.Tensor  # [n] rows of the flattened [B * Lq] output that are real tokens
    token_rows: torch.Tensor | None  # [n] step rows they belong to (None: all rows, in order)


@dataclass
class _PrefillRequest:
    """One request of a CPU prefill step attended on its own (one SDPA call, no padding)."""

    q_start: int  # its rows of the step's q: [q_start, q_start + n_q)
    n_q: int
    kv_index: torch.Tensor  # [Lkv] pool locations, cached prefix first
    # [Lq, Lkv] bool: causal after the prefix (+ sliding window); None: plain causal (no
    # prefix, no window), SDPA's is_causal
    mask: torch.Tensor | None


@dataclass
class _PrefillKernel:
    """The requests of a CPU prefill step attended by the C kernel in place over the pool (the
    short ones; with AMX tiles all of them up to PREFILL_AMX_MAX_KV positions): request r's q
    rows [q_starts[r], + q_lens[r]) and KV at kv_index[kv_starts[r]: + kv_lens[r]] (int64 host
    tensors, one entry a request)."""

    q_starts: torch.Tensor
    q_lens: torch.Tensor
    kv_starts: torch.Tensor
    kv_lens: torch.Tensor
    kv_index: torch.Tensor  # the step's KV locations
    amx: bool = False  # through the AMX kernel (`cpu_native.prefill_amx`), else the vector one


@dataclass
class _Meta:
    out_loc: torch.Tensor
    is_prefill: bool
    # prefill: one group per SDPA call, usually one for the whole step (see `_prefill_groups`),
    # and on a CPU the requests of at least PREFILL_ALONE_MIN_TOKENS new tokens, one by one
    groups: list[_PrefillGroup]
    requests: list[_PrefillRequest] = field(default_factory=list)
    kernel: _PrefillKernel | None = None
    # decode: KV lengths [bs]; paged: the step's KV locations and their indptr [bs + 1]; else
    # padded KV locations [bs, Lmax] (None after an append) and a mask [bs, 1, 1, Lmax]
    kv_lens: torch.Tensor | None = None
    kv_index: torch.Tensor | None = None
    kv_indptr: torch.Tensor | None = None
    kv_mask: torch.Tensor | None = None
    # decode: "paged" (the C kernel reads the pool in place), the SDPA workspace's "append" /
    # "rebuild" (see decode_workspace.py), or None (gather only)
    decode_mode: str | None = None
    ws_pos: torch.Tensor | None = None  # append: the position each request's new token takes


# a group may spend this much more attention work on padding than on real query/key pairs
_PAD_FACTOR = 2
_PAD_SLACK = 1 << 16
# On a CPU a request with this many new tokens attends on its own, one SDPA call without
# padding (is_causal where it has no cached prefix and no window): padded together, seed-
# offline's 16 prompts of 64-256 tokens took 37-55 ms a layer (bf16, 2 threads, no AMX), one
# by one 17 ms as two bmm calls around a softmax, and as SDPA 3-9x less than those bmm calls
# on an AMX Xeon (bf16 and fp32, 64-1024 tokens). Short requests stay padded together, or,
# with the C kernel, attend through it while their KV is at most PREFILL_KERNEL_MAX_KV long:
# 102 prompts of 16-64 tokens 2.8 ms a layer against 4.6 for padded SDPA (gathers included,
# bf16, 2 threads, AMX Xeon); past ~256 positions SDPA's bf16 GEMMs win (a 512-token prefix:
# 18 against 16 ms), the kernel computing in fp32 vectors.
PREFILL_ALONE_MIN_TOKENS = 64
PREFILL_KERNEL_MAX_KV = 256
# With AMX tiles (bf16, head_dim % 32 == 0: `cpu_native.prefill_amx`) the kernel's products are
# tile GEMMs and every request up to this many positions attends through it, long prompts
# included: one call a layer for the step (seed-offline's 16 prompts of 64-256 tokens: 1.5 ms
# against 3.9 for the vector kernel and ~4.3 for SDPA one request at a time; many-short's 102
# prompts 1.5 against 2.8 ms). Longer KV takes the padded SDPA call.
PREFILL_AMX_MAX_KV = 16384


def _prefill_groups(ext: np.ndarray, kv_lens: np.ndarray) -> list[np.ndarray]:
    """Partition the step's requests into SDPA calls: all of them in one call unless padding
    to the longest would more than double the attention work (then greedily by KV length)."""
    work = ext.astype(np.int64) * kv_lens
    bs = len(ext)
    if bs * int(ext.max()) * int(kv_lens.max()) <= _PAD_FACTOR * int(work.sum()) + _PAD_SLACK:
        return [np.arange(bs)]
    groups, cur = [], []
    for r in np.argsort(-kv_lens, kind="stable"):
        trial = [*cur, int(r)]
        padded = len(trial) * int(ext[trial].max()) * int(kv_lens[trial].max())
        if cur and padded > _PAD_FACTOR * int(work[trial].sum()) + _PAD_SLACK:
            groups.append(np.array(cur))
            trial = [int(r)]
        cur = trial
    groups.append(np.array(cur))
    return groups


@register_backend("torch_native")
class TorchNativeBackend(AttentionBackend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        pool = self.pool
        dtype = pool.k[0].dtype
        # on a CPU the C kernels (kernels/cpu): decode instead of SDPA, which spends its time per
        # (request, head) block on a few query rows, and a prefill step's short requests; both
        # read the KV pool in place (paged), so only SDPA keeps a dense decode workspace
        self.native = self.device.type == "cpu" and cpu_native.available(dtype)
        self.prefill_amx = self.native and cpu_native.prefill_amx(dtype, self.head_dim)
        self.workspace = DecodeWorkspace(len(pool.k), self.num_kv_heads, self.head_dim, dtype,
                                         self.device)  # fmt: skip
        # deterministic mode (`engine/deterministic.py`): every prefill step, and every decode
        # step unless the batch-invariant C decode step runs it (`decode_in_c`: paged
        # metadata), through the vector C prefill kernel (a query's result its own row's, in
        # one fixed order)
        self.deterministic = False
        self.decode_in_c = False
        self.prefill_alone_rows = 0  # prefill tokens attended one request at a time
        self.prefill_kernel_rows = 0  # prefill tokens attended by the C kernel

    def prepare(self, plan: StepPlan, staged: DevicePlan | None = None) -> _Meta:
        """Decode reads only the staged device arrays (host values: numpy, never the device);
        prefill still builds its padded group indices and masks on the host."""
        staged = staged or self.stage(plan)
        out_loc = staged.out_loc.long()
        kv_indices = staged.kv_indices.long()
        ext = plan.extend_lens
        if plan.is_prefill or (self.deterministic and not self.decode_in_c):
            self.workspace.invalidate()
            alone = np.zeros(len(ext), dtype=bool)
            kernel = np.zeros(len(ext), dtype=bool)
            if self.deterministic:
                kernel[:] = True
            elif self.prefill_amx:
                kernel = plan.seq_lens <= PREFILL_AMX_MAX_KV
                alone = ~kernel & (ext >= PREFILL_ALONE_MIN_TOKENS)
            elif self.device.type == "cpu":
                alone = ext >= PREFILL_ALONE_MIN_TOKENS
                if self.native:
                    kernel = ~alone & (plan.seq_lens <= PREFILL_KERNEL_MAX_KV)
            padded = np.flatnonzero(~alone & ~kernel)
            q_starts = np.cumsum(ext, dtype=np.int64) - ext  # each request's first query row
            groups = [
                self._prefill_group(
                    plan, padded[rows], q_starts, kv_indices, single=len(rows) == len(ext)
                )
                for rows in (
                    _prefill_groups(ext[padded], plan.seq_lens[padded]) if len(padded) else []
                )
            ]
            requests = [
                self._prefill_request(plan, int(r), int(q_starts[r]), kv_indices)
                for r in np.flatnonzero(alone)
            ]
            self.prefill_alone_rows += int(ext[alone].sum())
            self.prefill_kernel_rows += int(ext[kernel].sum())
            short = np.flatnonzero(kernel)
            kern = None
            if len(short):
                kern = _PrefillKernel(
                    *(torch.from_numpy(np.ascontiguousarray(a[short], dtype=np.int64))
                      for a in (q_starts, ext, plan.kv_indptr[:-1], plan.seq_lens)),
                    kv_index=kv_indices,
                    amx=self.prefill_amx and not self.deterministic,
                )  # fmt: skip
            return _Meta(out_loc, True, groups, requests, kernel=kern)
        lens = staged.seq_lens.long()
        if self.native:
            indptr = staged.kv_indptr.long()
            return _Meta(
                out_loc, False, [], kv_lens=lens, kv_index=kv_indices, kv_indptr=indptr,
                decode_mode="paged",
            )  # fmt: skip
        lmax = int(plan.seq_lens.max())
        mode = self.workspace.mode(plan.slots, plan.seq_lens)
        return self._decode_meta(out_loc, lens, staged.kv_indptr, kv_indices, lmax, mode)

    def _decode_meta(
        self,
        out_loc: torch.Tensor,
        lens: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        lmax: int,
        mode: str | None,
    ) -> _Meta:
        """Decode metadata from device arrays only (KV padded to `lmax` per request)."""
        ar = torch.arange(lmax, device=self.device)[None, :]
        valid = ar < lens[:, None]
        if self.sliding_window is not None:
            valid &= ar >= lens[:, None] - self.sliding_window
        mask = valid[:, None, None, :]
        if mode == "append":
            return _Meta(
                out_loc, False, [], kv_lens=lens, kv_mask=mask, decode_mode=mode, ws_pos=lens - 1
            )
        indptr = kv_indptr[:-1].long()
        # padding reads the request's last (written) location, so masked values stay finite
        last = indptr + lens - 1
        gather = torch.where(valid, indptr[:, None] + ar, last[:, None])
        return _Meta(
            out_loc,
            False,
            [],
            kv_lens=lens,
            kv_index=kv_indices[gather],
            kv_mask=mask,
            decode_mode=mode,
        )

    def graph_prepare(self, inputs: GraphInputs, bs: int) -> _Meta:
        """A decode step over the graph buffers: KV padded to the longest possible sequence
        (fixed shape), gathered, no workspace (the graph does not see host state)."""
        return self._decode_meta(
            inputs.out_loc[:bs].long(), inputs.seq_lens[:bs].long(), inputs.kv_indptr[: bs + 1],
            inputs.kv_indices, inputs.max_seq_len, None,
        )  # fmt: skip

    def compiles(self, meta: _Meta) -> bool:
        """Not an SDPA batch over the workspace budget: it gathers its whole KV every step (a
        graph of its own, and a GEMM-bound step that a compile does not speed up)."""
        return meta.decode_mode is not None

    def graph_key(self, meta: _Meta) -> str | None:
        return meta.decode_mode

    def before_replay(self) -> None:
        self.workspace.invalidate()  # the graph step appends KV the workspace does not hold

    def _prefill_request(
        self, plan: StepPlan, row: int, q0: int, kv_indices: torch.Tensor
    ) -> _PrefillRequest:
        n_q, n_kv = int(plan.extend_lens[row]), int(plan.seq_lens[row])
        kv0 = int(plan.kv_indptr[row])
        kv_index = kv_indices[kv0 : kv0 + n_kv]
        if n_q == n_kv and self.sliding_window is None:
            return _PrefillRequest(q0, n_q, kv_index, None)
        q_pos = np.arange(n_kv - n_q, n_kv)[:, None]
        kv_pos = np.arange(n_kv)[None, :]
        mask = kv_pos <= q_pos
        if self.sliding_window is not None:
            mask &= kv_pos > q_pos - self.sliding_window
        return _PrefillRequest(q0, n_q, kv_index, torch.from_numpy(mask).to(self.device))

    def _prefill_group(
        self,
        plan: StepPlan,
        rows: np.ndarray,
        q_starts: np.ndarray,
        kv_indices: torch.Tensor,
        single: bool,
    ) -> _PrefillGroup:
        dev = self.device
        n_q = plan.extend_lens[rows].astype(np.int64)
        n_kv = plan.seq_lens[rows].astype(np.int64)
        q0 = q_starts[rows]
        kv0 = plan.kv_indptr[:-1].astype(np.int64)[rows]
        lq, lkv = int(n_q.max()), int(n_kv.max())
        i = np.minimum(np.arange(lq)[None, :], n_q[:, None] - 1)  # [B, Lq]
        j = np.minimum(np.arange(lkv)[None, :], n_kv[:, None] - 1)  # [B, Lkv]
        q_pos = (n_kv - n_q)[:, None] + i
        kv_pos = np.arange(lkv)[None, None, :]
        mask = (kv_pos <= q_pos[:, :, None]) & (kv_pos < n_kv[:, None, None])
        if self.sliding_window is not None:
            mask &= kv_pos > q_pos[:, :, None] - self.sliding_window
        valid = np.arange(lq)[None, :] < n_q[:, None]
        out_index = np.flatnonzero(valid)
        token_rows = None if single else torch.from_numpy((q0[:, None] + i)[valid]).to(dev)
        return _PrefillGroup(
            q_index=torch.from_numpy(q0[:, None] + i).to(dev),
            kv_index=kv_indices[torch.from_numpy(kv0[:, None] + j).to(dev)],
            mask=torch.from_numpy(mask[:, None]).to(dev),
            out_index=torch.from_numpy(out_index).to(dev),
            token_rows=token_rows,
        )

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: _Meta,
        stored: bool = False,
    ) -> torch.Tensor:
        assert not stored, "torch_native stores K/V itself (its kv_slots is None)"
        if meta.is_prefill and self.native and not torch.compiler.is_compiling():
            cpu_native.store_rows(self.pool.k[layer], meta.out_loc, k)  # row copies in C
            cpu_native.store_rows(self.pool.v[layer], meta.out_loc, v)
        else:
            self.pool.store(layer, meta.out_loc, k, v)
        if meta.is_prefill:
            return self._prefill(layer, q, meta)
        return self._decode(layer, q, k, v, meta)

    def _prefill(self, layer: int, q: torch.Tensor, meta: _Meta) -> torch.Tensor:
        """A prefill step's attention: the C kernel's requests, SDPA's per request and in
        padded groups of requests, written into one output in step order."""
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        kvh, gqa = self.num_kv_heads, self.num_heads // self.num_kv_heads
        d = q.shape[-1]
        single = len(meta.groups) == 1 and not meta.requests and meta.kernel is None
        out = None if single else q.new_empty(q.shape[0], q.shape[1] * d)
        if meta.kernel is not None:
            assert out is not None  # rows of the other requests are written below
            kn, n = meta.kernel, q.shape[0]
            cpu_native.prefill_attention(
                q.reshape(n, kvh, gqa, d), k_cache, v_cache, kn.kv_index, kn.q_starts,
                kn.q_lens, kn.kv_starts, kn.kv_lens, self.sliding_window or 0,
                out=out.view(n, kvh, gqa, d), amx=kn.amx,
            )  # fmt: skip
        for r in meta.requests:
            rows = slice(r.q_start, r.q_start + r.n_q)
            qs = q[rows].transpose(0, 1)[None]  # [1, H, Lq, D]
            ks = _gather(k_cache, r.kv_index).transpose(0, 1)[None]  # [1, KVH, Lkv, D]
            vs = _gather(v_cache, r.kv_index).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=r.mask, is_causal=r.mask is None, enable_gqa=gqa > 1
            )
            out[rows] = o[0].transpose(0, 1).reshape(r.n_q, -1)
        for g in meta.groups:
            n_b, n_q = g.q_index.shape
            qs = q[g.q_index].transpose(1, 2)  # [B, H, Lq, D]
            ks = _gather(k_cache, g.kv_index).transpose(1, 2)  # [B, KVH, Lkv, D]
            vs = _gather(v_cache, g.kv_index).transpose(1, 2)
            # GQA in SDPA (head h reads KV head h // gqa, as HF's repeat_kv): the same
            # values as folding the query heads into the query length with a repeated
            # mask, 1.6-2.3x faster (bf16, 102 prompts of <= 64 tokens, 2 threads)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=g.mask, enable_gqa=gqa > 1)
            o = o.transpose(1, 2).reshape(n_b * n_q, -1)
            if out is None:  # the whole step in one call, rows already in step order
                return o[g.out_index]
            out[g.token_rows] = o[g.out_index]
        return out

    def _decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: _Meta
    ) -> torch.Tensor:
        """A decode step's attention: the paged C kernel, or the KV gathered (or kept in the
        workspace) and the C decode kernel or SDPA over it."""
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        kvh, gqa = self.num_kv_heads, self.num_heads // self.num_kv_heads
        d = q.shape[-1]
        bs = q.shape[0]
        # the output's width from q's shape (the model's constants): from the backend's head
        # counts it is a symbol of a compiled graph, which inductor's GEMM templates refuse
        width = q.shape[1] * q.shape[2]
        qs = q.view(bs, kvh, gqa, d)
        window = self.sliding_window or 0
        if meta.decode_mode == "paged":
            o = cpu_native.paged_decode_attention(
                qs.to(k_cache.dtype), k_cache, v_cache, meta.kv_index, meta.kv_indptr,
                meta.kv_lens, window,
            )  # fmt: skip
            return o.to(q.dtype).reshape(bs, width)
        lmax = meta.kv_mask.shape[-1]
        ws = self.workspace
        native = self.native and q.dtype == k_cache.dtype
        if meta.decode_mode is not None:
            assert ws.k is not None and ws.v is not None
            # the workspace is written by index_put_ on its [layers, ...] tensors themselves:
            # written through a layer's view, a compiled graph copied the layer's whole block
            # (functionalized as a select_scatter) on every step, ~75 us a layer at batch 1
            at = torch.full((), layer, dtype=torch.long, device=q.device)
        if meta.decode_mode == "append":
            rows = torch.arange(bs, device=q.device)
            torch.ops.aten.index_put_(ws.k, [at, rows, None, meta.ws_pos], k)
            torch.ops.aten.index_put_(ws.v, [at, rows, None, meta.ws_pos], v)
            # the kernel takes the whole workspace and reads each request's length (a view of
            # lmax positions turns contiguous once lmax reaches the capacity, and a compiled
            # graph specialises on that: a compile mid-serving)
            ks, vs = ws.k[layer], ws.v[layer]
            if not native:
                ks, vs = ks[:, :, :lmax], vs[:, :, :lmax]
        else:
            assert meta.kv_index is not None
            ks = _gather(k_cache, meta.kv_index).transpose(1, 2)  # [bs, KVH, L, D]
            vs = _gather(v_cache, meta.kv_index).transpose(1, 2)
            if meta.decode_mode == "rebuild":  # positions [0, lmax) of every request
                pos = torch.arange(lmax, device=q.device)
                torch.ops.aten.index_put_(ws.k, [at, None, None, pos], ks.permute(2, 0, 1, 3))
                torch.ops.aten.index_put_(ws.v, [at, None, None, pos], vs.permute(2, 0, 1, 3))
        if native:
            o = cpu_native.decode_attention(qs, ks, vs, meta.kv_lens, window)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.kv_mask)
        return o.reshape(bs, width)


def _gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache[index] for a [N, KVH, D] pool: an embedding lookup over flattened rows, several
    times faster on CPU than advanced indexing or a 3-D index_select (same values)."""
    rows = F.embedding(index, cache.view(cache.shape[0], -1))
    return rows.view(*index.shape, *cache.shape[1:])
