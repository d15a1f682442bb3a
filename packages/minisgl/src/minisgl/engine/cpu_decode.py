"""Decode steps of an int4 or w8a8 bf16 model on a CPU as one C call (`kernels/cpu/decode_step.c`,
`kernels/cpu/decode_step_w8a8.c`).

Through the torch modules a batch-1 decode step of the embedded model runs ~500 ops, each a
dispatch of a few microseconds: ~6 of its ~14 ms (AMD EPYC, 2 threads). Here the decoder layers
are one call and the lm_head a second. An int4 model (`cpu_native.int4.decode_layers`, then
`int4_gemv`): the int4 GEMVs multiply the codes by int8 activations on VNNI, the rest are plain
loops over the rows. A w8a8 model (`cpu_native.w8a8_step.decode_layers`, card P2-006): the
modules' arithmetic op for op, its int8 GEMMs over weights repacked into panels of 16 channels
(~150-180 GMAC/s a core at 16-64 rows on an AMD EPYC, where oneDNN's int8 GEMM ran 80-150 at 16
and ~7-18 at one row); the final norm and the weight-only lm_head are the modules'. It runs
decode steps of at most `MAX_ROWS` (64) requests, through the C paged decode attention; every
other step, and every other model, takes the modules.

`MINISGL_CPU_DECODE`: `auto` (default) runs int4 models here on every CPU and w8a8 models on
CPUs with AVX512-VNNI and AVX512-BF16 but without AMX-INT8 (with it, oneDNN's AMX kernels: not
measured against this step; without the two, the step's kernels are plain loops); `c` runs
every model it can here; `modules` none (an A/B switch and the reference of the tests).
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from minisgl.kernels import cpu as cpu_native
from minisgl.kernels.cpu import int4, step_layers, w8a8_step
from minisgl.kvcache.pool import KVPool
from minisgl.quantization.linear import Int4Linear, Int8Linear
from minisgl.quantization.w8a8 import W8A8MLP, W8A8Linear
from minisgl.utils.cpu import cpu_flags
from minisgl.utils.log import get_logger

logger = get_logger(__name__)

# decode rows a step runs here at most: its GEMM multiplies each unpacked block of weights by 4
# input rows at a time (decode_step.c's `tile`), compute-bound from a few rows at ~57 GMAC/s a
# core; the modules de-quantize to bf16 from 64 rows for oneDNN, ~75 (embedded model, AMD EPYC,
# 1 thread, CPU time a step: 16 rows 47.7 ms against 75.1 through the modules, 64 rows 175
# against 202, 128 rows 350 against 340)
MAX_ROWS = 64
# w8a8: the panel GEMM is compute-bound at oneDNN's rate from ~64 rows, and the step saves the
# modules' per-op work (the lm_head's de-quantized copy from 32 rows, ~120 dispatched ops)
W8A8_MAX_ROWS = 256
MODES = ("auto", "c", "modules")  # MINISGL_CPU_DECODE


def mode() -> str:
    """`MINISGL_CPU_DECODE` (auto, c or modules); ValueError on another value."""
    got = os.environ.get("MINISGL_CPU_DECODE", "auto").strip().lower()
    if got not in MODES:
        raise ValueError(f"MINISGL_CPU_DECODE must be one of {MODES}, got {got!r}")
    return got


def amx_int8() -> bool:
    """Whether oneDNN multiplies the w8a8 modules' int8 GEMMs on AMX tiles here."""
    return "amx_int8" in cpu_flags()


def _matrix(layer: nn.Module) -> int4.Int4Matrix | None:
    if not isinstance(layer, Int4Linear) or layer.scales_zeros.dtype != torch.bfloat16:
        return None
    return int4.Int4Matrix.of(layer.codes, layer.scales_zeros, layer.bias)


def _decoder_linears(model: nn.Module) -> list[nn.Module]:
    return [m for layer in model.model.layers
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                      layer.mlp.gate_up_proj, layer.mlp.down_proj)]  # fmt: skip


def kind_of(model: nn.Module) -> str | None:
    """ "int4" (every decoder linear and the lm_head `Int4Linear`), "w8a8" (every decoder linear
    `W8A8Linear`, the input norms folded into QKV and gate/up, `W8A8MLP`), else None."""
    linears = _decoder_linears(model)
    if all(isinstance(m, Int4Linear) for m in [model.lm_head, *linears]):
        return "int4"
    folded = all(isinstance(layer.mlp, W8A8MLP) and layer.self_attn.qkv_proj.norm is not None
                 for layer in model.model.layers)  # fmt: skip
    if all(isinstance(m, W8A8Linear) for m in linears) and folded:
        return "w8a8"
    return None


def unsupported(model: nn.Module, pool: KVPool, device: torch.device) -> str | None:
    """Why `CpuDecode` does not run this model (None: it does); ValueError on a bad
    `MINISGL_CPU_DECODE`."""
    how = mode()
    if how == "modules":
        return "MINISGL_CPU_DECODE=modules"
    if device.type != "cpu" or not cpu_native.available(torch.bfloat16):
        return "not a CPU with the C kernels"
    if pool.k[0].dtype != torch.bfloat16:
        return f"a {pool.k[0].dtype} model (bf16 only)"
    if getattr(getattr(model, "config", None), "moe", None) is not None:
        return "a mixture-of-experts model (the C step runs dense MLPs)"
    kind = kind_of(model)
    if kind is None:
        return "not every linear is int4, nor a fused w8a8 model"
    if kind == "w8a8" and how == "auto" and amx_int8():
        return "w8a8 with AMX-INT8: oneDNN's AMX kernels (MINISGL_CPU_DECODE=c: the C step)"
    if kind == "w8a8" and how == "auto" and not {"avx512_vnni", "avx512_bf16"} <= cpu_flags():
        return "w8a8 without AVX512-VNNI and AVX512-BF16: the C step's kernels would be plain loops"
    k = pool.k[0]
    if k.stride(2) != 1 or k.stride(1) != k.shape[2] or pool.v[0].stride() != k.stride():
        return "a KV pool layout other than [rows, kv_heads, head_dim]"
    return None


def _norm(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().bfloat16().contiguous()


def _panels(layer: nn.Module) -> w8a8_step.Int8Panels:
    return w8a8_step.Int8Panels.of(layer.qweight, layer.scales, layer.bias)


def _qk_norms(layer: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    att = layer.self_attn
    return (_norm(att.q_norm.weight), _norm(att.k_norm.weight)) if att.qk_norm else (None, None)


def _int4_layer(layer: nn.Module) -> int4.LayerWeights:
    att, mlp = layer.self_attn, layer.mlp
    mats = [_matrix(m) for m in (att.qkv_proj, att.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    assert all(m is not None for m in mats)
    return int4.LayerWeights(*mats, _norm(layer.input_layernorm.weight),  # type: ignore[arg-type]
                             _norm(layer.post_attention_layernorm.weight), *_qk_norms(layer))  # fmt: skip


def _w8a8_layer(layer: nn.Module) -> w8a8_step.LayerWeights:
    """The norms are those folded into the linears they feed (`fuse_w8a8_inputs`)."""
    att, gu = layer.self_attn, layer.mlp.gate_up_proj
    return w8a8_step.LayerWeights(
        _panels(att.qkv_proj), _panels(att.o_proj), _panels(gu), _panels(layer.mlp.down_proj),
        _norm(att.qkv_proj.norm.weight), _norm(gu.norm.weight), *_qk_norms(layer),
    )  # fmt: skip


class CpuDecode:
    """The C decode step of one model and KV pool (`unsupported` first); `kind` int4 or w8a8.
    `invariant` (deterministic mode, int4): a row's bits do not depend on the other rows of its
    step (one row through the GEMM's multi-row tiles), and every decode step runs here, however
    many rows (a step through the modules would compute other numbers)."""

    def __init__(
        self, model: nn.Module, pool: KVPool, window: int | None, invariant: bool = False
    ) -> None:
        cfg = model.config
        kind = kind_of(model)
        assert kind is not None
        self.model, self.kind = model, kind
        build = _int4_layer if kind == "int4" else _w8a8_layer
        self.layers = [build(layer) for layer in model.model.layers]
        steps = int4 if kind == "int4" else w8a8_step
        self.structs = step_layers.layer_structs(steps.LAYER_RECORD, self.layers, pool.k, pool.v)
        self.final_norm = _norm(model.model.norm.weight)
        self.head = _matrix(model.lm_head) if kind == "int4" else None
        # a w8a8 model's weight-only int8 lm_head (bf16 activations) through the C head
        lm = model.lm_head
        self.head8 = (w8a8_step.HeadPanels.of(lm.qweight, lm.scales)
                      if kind == "w8a8" and isinstance(lm, Int8Linear) and lm.bias is None
                      and getattr(model, "comm", None) is None else None)  # fmt: skip
        self.dims = int4.Dims(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                              cfg.intermediate_size, float(cfg.rms_norm_eps))  # fmt: skip
        self.pool_rows, self.row_stride = pool.k[0].shape[0], pool.k[0].stride(0)
        self.window = window or 0
        if invariant and kind != "int4":
            raise ValueError(f"the C decode step of a {kind} model is not batch-invariant")
        self.invariant = invariant
        self.max_rows = MAX_ROWS if kind == "int4" else W8A8_MAX_ROWS
        if invariant:
            self.max_rows = sys.maxsize
        self.steps = 0  # decode steps run here (tests read it)

    def runs(self, num_tokens: int, meta: object) -> bool:
        """Whether a decode step of `num_tokens` rows with this attention metadata runs here."""
        return num_tokens <= self.max_rows and getattr(meta, "decode_mode", None) == "paged"

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 logits_indices: torch.Tensor, backend: object, meta: object) -> torch.Tensor:  # fmt: skip
        """The model's forward for a decode step: logits [len(logits_indices), vocab], bf16."""
        model, rotary = self.model, self.model.rotary
        x = model.embed(input_ids).to(torch.bfloat16).contiguous()
        cos = rotary.cos[positions].to(torch.bfloat16).contiguous()
        sin = rotary.sin[positions].to(torch.bfloat16).contiguous()
        args = (
            cos, sin, meta.out_loc.contiguous(), meta.kv_index.contiguous(),  # type: ignore[attr-defined]
            meta.kv_indptr.contiguous(), meta.kv_lens.contiguous(),  # type: ignore[attr-defined]
            self.pool_rows, self.row_stride, self.window,
        )  # fmt: skip
        self.steps += 1
        if self.kind == "w8a8":  # the final norm: the module's
            w8a8_step.decode_layers(self.structs, self.dims, x, *args)
            h = model.model.norm(x[logits_indices])
            return model.logits(h) if self.head8 is None else w8a8_step.int8_head(h, self.head8)
        normed = int4.decode_layers(
            self.structs, self.dims, x, self.final_norm, *args, invariant=self.invariant
        )
        assert self.head is not None
        return int4.int4_gemv(normed[logits_indices], self.head, invariant=self.invariant)
