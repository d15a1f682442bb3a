"""Torch-native attention over the paged KV pool (CPU and CUDA; the reference backend)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.attention import register_backend
from minisgl.attention.base import AttentionBackend
from minisgl.attention.decode_workspace import DecodeWorkspace
from minisgl.scheduler.plan import StepPlan

_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class _Meta:
    out_loc: torch.Tensor
    is_prefill: bool
    # prefill: one entry per request (q rows, kv locations, boolean mask [q, kv]); the mask is
    # None for a fresh causal prompt (nothing cached, no sliding window): see `forward`
    segments: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]
    # decode: padded KV locations [bs, Lmax] and mask [bs, 1, 1, Lmax]
    kv_index: torch.Tensor | None = None
    kv_mask: torch.Tensor | None = None
    # decode workspace: "append" / "rebuild" (see decode_workspace.py) or None (gather only)
    ws_mode: str | None = None
    ws_pos: torch.Tensor | None = None  # append: the position each request's new token takes


@register_backend("torch_native")
class TorchNativeBackend(AttentionBackend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        pool = self.pool
        self.workspace = DecodeWorkspace(len(pool.k), self.num_kv_heads, self.head_dim,
                                         pool.k[0].dtype, self.device)  # fmt: skip

    def prepare(self, plan: StepPlan) -> _Meta:
        dev = self.device
        out_loc = torch.from_numpy(plan.out_loc).to(dev, torch.int64)
        kv_indices = torch.from_numpy(plan.kv_indices).to(dev, torch.int64)
        seq_lens = plan.seq_lens.tolist()
        ext = plan.extend_lens.tolist()
        if plan.is_prefill:
            self.workspace.invalidate()
            segments = []
            q0, kv0 = 0, 0
            for n_q, n_kv in zip(ext, seq_lens, strict=True):
                if n_q == n_kv and self.sliding_window is None and _SDPA_GQA:
                    segments.append((q0, n_q, kv_indices[kv0 : kv0 + n_kv], None))
                    q0 += n_q
                    kv0 += n_kv
                    continue
                q_pos = torch.arange(n_kv - n_q, n_kv, device=dev)[:, None]
                kv_pos = torch.arange(n_kv, device=dev)[None, :]
                mask = kv_pos <= q_pos
                if self.sliding_window is not None:
                    mask &= kv_pos > q_pos - self.sliding_window
                segments.append((q0, n_q, kv_indices[kv0 : kv0 + n_kv], mask))
                q0 += n_q
                kv0 += n_kv
            return _Meta(out_loc, True, segments)
        lens = torch.from_numpy(plan.seq_lens).to(dev, torch.int64)
        lmax = max(seq_lens)
        ar = torch.arange(lmax, device=dev)[None, :]
        valid = ar < lens[:, None]
        if self.sliding_window is not None:
            valid &= ar >= lens[:, None] - self.sliding_window
        mode = self.workspace.mode(plan.slots, plan.seq_lens)
        if mode == "append":
            return _Meta(out_loc, False, [], None, valid[:, None, None, :], mode, lens - 1)
        indptr = torch.from_numpy(plan.kv_indptr[:-1]).to(dev, torch.int64)
        # padding reads the request's last (written) location, so masked values stay finite
        last = indptr + lens - 1
        gather = torch.where(valid, indptr[:, None] + ar, last[:, None])
        kv_index = kv_indices[gather]
        return _Meta(out_loc, False, [], kv_index, valid[:, None, None, :], mode)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: _Meta
    ) -> torch.Tensor:
        self.pool.store(layer, meta.out_loc, k, v)
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        kvh, gqa = self.num_kv_heads, self.num_heads // self.num_kv_heads
        d = q.shape[-1]
        # GQA without repeating K/V: the `gqa` query heads sharing a KV head are folded into
        # the query-length dimension (head h uses KV head h // gqa, as in HF's repeat_kv).
        if meta.is_prefill:
            out = torch.empty_like(q)
            for q0, n_q, kv_idx, mask in meta.segments:
                if mask is None:  # fresh prompt: its own K/V, plain causal attention
                    o = F.scaled_dot_product_attention(
                        q[q0 : q0 + n_q].transpose(0, 1),
                        k[q0 : q0 + n_q].transpose(0, 1),
                        v[q0 : q0 + n_q].transpose(0, 1),
                        is_causal=True,
                        enable_gqa=gqa > 1,
                    )
                    out[q0 : q0 + n_q] = o.transpose(0, 1)
                    continue
                qs = q[q0 : q0 + n_q].transpose(0, 1).reshape(kvh, gqa * n_q, d)
                ks = _gather(k_cache, kv_idx).transpose(0, 1)  # [KVH, kv, D]
                vs = _gather(v_cache, kv_idx).transpose(0, 1)
                m = mask.repeat(gqa, 1) if gqa > 1 else mask
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=m)
                out[q0 : q0 + n_q] = o.view(kvh * gqa, n_q, d).transpose(0, 1)
            return out.reshape(q.shape[0], -1)
        bs = q.shape[0]
        lmax = meta.kv_mask.shape[-1]
        ws = self.workspace
        if meta.ws_mode == "append":
            rows = torch.arange(bs, device=q.device)
            ws.k[layer][rows, :, meta.ws_pos] = k
            ws.v[layer][rows, :, meta.ws_pos] = v
            ks, vs = ws.k[layer][:, :, :lmax], ws.v[layer][:, :, :lmax]
        else:
            assert meta.kv_index is not None
            ks = _gather(k_cache, meta.kv_index).transpose(1, 2)  # [bs, KVH, L, D]
            vs = _gather(v_cache, meta.kv_index).transpose(1, 2)
            if meta.ws_mode == "rebuild":
                ws.k[layer][:, :, :lmax] = ks
                ws.v[layer][:, :, :lmax] = vs
        qs = q.view(bs, kvh, gqa, d)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.kv_mask)
        return o.reshape(bs, -1)


def _gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache[index] for a [N, KVH, D] pool: an embedding lookup over flattened rows, several
    times faster on CPU than advanced indexing or a 3-D index_select (same values)."""
    rows = F.embedding(index, cache.view(cache.shape[0], -1))
    return rows.view(*index.shape, *cache.shape[1:])
