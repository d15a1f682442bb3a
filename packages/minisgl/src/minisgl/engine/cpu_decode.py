"""Decode steps of an int4 bf16 model on a CPU as one C call (`kernels/cpu/decode_step.c`).

Through the torch modules a batch-1 decode step of the embedded model runs ~500 ops, each a
dispatch of a few microseconds: ~6 of its ~14 ms (AMD EPYC, 2 threads). Here the decoder layers
and the final norm are one call (`cpu_native.int4.decode_layers`) and the lm_head a second
(`int4_gemv`): the int4 GEMVs multiply the codes by int8 activations on VNNI, the rest are
plain loops over the rows. It runs decode steps of at most `MAX_ROWS` (64) requests of a model
whose decoder linears and lm_head are all `Int4Linear` (bf16), through the C paged decode
attention; every other step, and every other model, takes the modules. `MINISGL_CPU_DECODE=
modules` turns it off (an A/B switch and the reference of its tests).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from minisgl.kernels import cpu as cpu_native
from minisgl.kernels.cpu import int4
from minisgl.kvcache.pool import KVPool
from minisgl.quantization.linear import Int4Linear
from minisgl.utils.log import get_logger

logger = get_logger(__name__)

# decode rows a step runs here at most: its GEMM multiplies each unpacked block of weights by 4
# input rows at a time (decode_step.c's `tile`), compute-bound from a few rows at ~57 GMAC/s a
# core; the modules de-quantize to bf16 from 64 rows for oneDNN, ~75 (embedded model, AMD EPYC,
# 1 thread, CPU time a step: 16 rows 47.7 ms against 75.1 through the modules, 64 rows 175
# against 202, 128 rows 350 against 340)
MAX_ROWS = 64


def _matrix(layer: nn.Module) -> int4.Int4Matrix | None:
    if not isinstance(layer, Int4Linear) or layer.scales_zeros.dtype != torch.bfloat16:
        return None
    return int4.Int4Matrix.of(layer.codes, layer.scales_zeros, layer.bias)


def unsupported(model: nn.Module, pool: KVPool, device: torch.device) -> str | None:
    """Why `CpuDecode` cannot run this model (None: it can)."""
    if os.environ.get("MINISGL_CPU_DECODE", "c") == "modules":
        return "MINISGL_CPU_DECODE=modules"
    if device.type != "cpu" or not cpu_native.available(torch.bfloat16):
        return "not a CPU with the C kernels"
    if pool.k[0].dtype != torch.bfloat16:
        return f"a {pool.k[0].dtype} model (bf16 only)"
    head = model.lm_head
    linears = [head] + [m for layer in model.model.layers
                        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                  layer.mlp.gate_up_proj, layer.mlp.down_proj)]  # fmt: skip
    if not all(isinstance(m, Int4Linear) for m in linears):
        return "not every linear is int4"
    k = pool.k[0]
    if k.stride(2) != 1 or k.stride(1) != k.shape[2] or pool.v[0].stride() != k.stride():
        return "a KV pool layout other than [rows, kv_heads, head_dim]"
    return None


class CpuDecode:
    """The C decode step of one model and KV pool (`unsupported` first)."""

    def __init__(self, model: nn.Module, pool: KVPool, window: int | None) -> None:
        cfg = model.config
        self.model = model
        self.layers = []
        for layer in model.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            mats = [_matrix(m) for m in (att.qkv_proj, att.o_proj, mlp.gate_up_proj,
                                         mlp.down_proj)]  # fmt: skip
            assert all(m is not None for m in mats)
            qk = att.qk_norm
            self.layers.append(int4.LayerWeights(
                *mats,  # type: ignore[arg-type]
                in_norm=layer.input_layernorm.weight.detach().bfloat16().contiguous(),
                post_norm=layer.post_attention_layernorm.weight.detach().bfloat16().contiguous(),
                q_norm=att.q_norm.weight.detach().bfloat16().contiguous() if qk else None,
                k_norm=att.k_norm.weight.detach().bfloat16().contiguous() if qk else None,
            ))  # fmt: skip
        self.structs = int4.layer_structs(self.layers, pool.k, pool.v)
        self.final_norm = model.model.norm.weight.detach().bfloat16().contiguous()
        head = _matrix(model.lm_head)
        assert head is not None
        self.head = head
        self.dims = int4.Dims(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                              cfg.intermediate_size, float(cfg.rms_norm_eps))  # fmt: skip
        self.pool_rows, self.row_stride = pool.k[0].shape[0], pool.k[0].stride(0)
        self.window = window or 0
        self.steps = 0  # decode steps run here (tests read it)

    def runs(self, num_tokens: int, meta: object) -> bool:
        """Whether a decode step of `num_tokens` rows with this attention metadata runs here."""
        return num_tokens <= MAX_ROWS and getattr(meta, "decode_mode", None) == "paged"

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 logits_indices: torch.Tensor, backend: object, meta: object) -> torch.Tensor:  # fmt: skip
        """The model's forward for a decode step: logits [len(logits_indices), vocab], bf16."""
        rotary = self.model.rotary
        x = self.model.model.embed_tokens(input_ids).to(torch.bfloat16).contiguous()
        cos = rotary.cos[positions].to(torch.bfloat16).contiguous()
        sin = rotary.sin[positions].to(torch.bfloat16).contiguous()
        normed = int4.decode_layers(
            self.structs, self.dims, x, self.final_norm, cos, sin,
            meta.out_loc.contiguous(), meta.kv_index.contiguous(),  # type: ignore[attr-defined]
            meta.kv_indptr.contiguous(), meta.kv_lens.contiguous(),  # type: ignore[attr-defined]
            self.pool_rows, self.row_stride, self.window,
        )  # fmt: skip
        self.steps += 1
        return int4.int4_gemv(normed[logits_indices], self.head)
