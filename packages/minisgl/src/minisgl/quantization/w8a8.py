"""W8A8 linears on CPU (`quantization="w8a8"`, card P2-004): int8 weights per output channel,
activations quantized per row at every row count, one int8 x int8 GEMM on the CPU's int8
matrix units (AMX-INT8, else AVX512-VNNI) through oneDNN, then both scales.

The weight-only int8 layers (`linear.Int8Linear`) widen every weight to bf16 before the
multiply: on the embedded model a batch-128 decode step's linears took 23.6 ms in inductor's
AMX template and a prefill step's GEMMs ran at 2.3-3.1 TFLOP/s on de-quantized copies. oneDNN's
int8 GEMM (`onednn::qlinear_pointwise`, weights prepacked once at load) multiplies the int8
bytes as they are: 11.4 ms for the same decode step's linears, 4.8-5.1 TOP/s on the prefill
shapes (2 threads, AMX). Activations are quantized per row, symmetric (`quantize_rows`): torch
ops that a compiled graph fuses into the norm or SiLU before the GEMM. Per-row int8 activations
alone cost the embedded model perplexity (38.51 against 37.50 in fp32, and its answer to the
capital of France in an HF simulation of every linear); with the SmoothQuant factors folded into
the weights at load (`smooth.py`) it measured 36.84-36.91.

The GEMM is an operator (`minisgl::w8a8_mm`) that compiled graphs call as it is. It finds a
weight's prepacked copy by the weight's storage (`_PACKED`, filled at load; a weight it has
not seen, e.g. a copy a graph made, is packed on first use), so graphs pass the plain int8
tensor. That keeps the plain weights beside the packed ones (twice the int8 bytes): the tied
embedding and the decode graphs' weight-only template read them.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.kernels import cpu as cpu_native
from minisgl.kernels.oplib import define_op
from minisgl.models.layers import RMSNorm, rms_norm
from minisgl.quantization import linear
from minisgl.quantization.packed import Int8Weight
from minisgl.utils.cpu import amx_tiles, cpu_flags

# a weight's storage (address, shape) -> (its strides, oneDNN's packed copy, its zero points);
# an entry leaves with the tensor that registered it (`weakref.finalize`), so a freed model's
# packed weights go with it and a later tensor at the same address is packed afresh
_PACKED: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = {}


@functools.cache
def w8a8_supported() -> bool:
    """Whether this CPU multiplies int8 by int8 in hardware (AMX-INT8 or AVX512-VNNI) and this
    torch has oneDNN's int8 linear."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.onednn, "qlinear_prepack"):
        return False
    return not cpu_flags().isdisjoint({"amx_int8", "avx512_vnni"})


# why W8A8 refuses a CPU without them: oneDNN's AVX2 int8 kernel (`gemm:jit`) sums pairs of
# u8 x s8 products in saturating int16 (`vpmaddubsw`); on an AMD EPYC without VNNI its outputs
# for codes in [-127, 127] were 20-25% of their range off, with s8 or u8 activations alike
UNSUPPORTED = (
    "needs a CPU with int8 matrix instructions (AMX-INT8 or AVX512-VNNI) and a torch with "
    "oneDNN's int8 linear: without them oneDNN's int8 GEMM sums products in saturating int16"
)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> int8 [M, K] and fp32 scales [M, 1]: scale = max |row| / 127, each value
    rounded to nearest (ties to even) of x / scale. A zero row gets a tiny scale and zeros."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(xf / scale).clamp(-127, 127).to(torch.int8), scale


def _input_rows(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    in_scale: torch.Tensor | None,
    eps: float,
    kind: str,
) -> torch.Tensor:
    """The rows `quantize_input` codes, as the model's eager ops form them in x's dtype."""
    if kind == "rmsnorm":
        assert weight is not None
        return rms_norm(x, weight, eps)
    if kind == "silu_mul":
        if in_scale is not None:
            x = (x.float() * in_scale.reshape(-1, 1)).to(x.dtype)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return x


def quantize_input(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    in_scale: torch.Tensor | None,
    eps: float,
    kind: str,
    u8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of a linear's input formed from x [rows, k] by `kind`: "rows" (x
    itself), "rmsnorm" (x's RMSNorm by `weight` [k] and `eps`), "silu_mul" (SiLU(gate) x up of
    x's halves [rows, 2n], both scaled by `in_scale` [rows] or [rows, 1] first: an int8 GEMM's
    output before its per-row activation scale), as the model's eager ops form it in x's dtype.
    `u8`: the codes + 128 as uint8 (`int8_gemm` takes either).
    A bf16 x takes one C pass (`cpu_native.quant_rows`: the row formed, each intermediate
    rounded to bf16 as those ops round it, its maximum and its codes, no tensor in between; a
    code may differ by one where it lies within a rounding of a half), others the torch ops.

    Why the bf16 roundings: rows formed in fp32 (as inductor's fused loops form them) were
    0.3 ms faster a gate/up call of [2587, 2 x 1536], but the embedded model's perplexity, as
    the geometric mean over 11 texts, was 0.6-1% higher (47.45 against 47.17 with the
    weight-only lm_head; fp32 46.87). On the card's one 108-token text neutral changes move it
    by several percent (dividing by the scale or multiplying by its inverse, in the unfused
    model: 36.91 or 37.42)."""
    if kind not in cpu_native.QUANT_KINDS:
        raise ValueError(f"quantize_input: kind must be one of {cpu_native.QUANT_KINDS}, "
                         f"got {kind!r}")  # fmt: skip
    if x.dim() != 2:
        raise ValueError(f"quantize_input: x must be [rows, k], got {tuple(x.shape)}")
    if kind == "rmsnorm" and (weight is None or tuple(weight.shape) != (x.shape[1],)):
        got = None if weight is None else tuple(weight.shape)
        raise ValueError(f"quantize_input: rmsnorm needs a weight of [{x.shape[1]}], got {got}")
    if kind == "silu_mul" and x.shape[1] % 2:
        raise ValueError(f"quantize_input: silu_mul needs an even width, got {x.shape[1]}")
    if in_scale is not None and in_scale.numel() != x.shape[0]:
        raise ValueError(
            f"quantize_input: in_scale needs {x.shape[0]} rows, got {in_scale.numel()}"
        )
    fused = (x.dtype == torch.bfloat16 and x.stride(-1) == 1 and x.device.type == "cpu"
             and (weight is None or weight.dtype == torch.bfloat16)
             and cpu_native.available(torch.bfloat16))  # fmt: skip
    if fused and x.shape[0] > 0:
        return cpu_native.quant_rows(x, weight, in_scale, eps, kind, unsigned=u8)
    codes, scales = quantize_rows(_input_rows(x, weight, in_scale, eps, kind))
    return (codes.view(torch.uint8) ^ 0x80 if u8 else codes), scales


def _packed(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    key = (qweight.untyped_storage().data_ptr() + qweight.storage_offset(), tuple(qweight.shape))
    hit = _PACKED.get(key)
    if hit is None or hit[0] != qweight.stride():
        zeros = torch.zeros(qweight.shape[0], dtype=torch.int64)
        packed = torch.ops.onednn.qlinear_prepack(qweight.contiguous(), None)
        hit = _PACKED[key] = (qweight.stride(), packed, zeros)
        weakref.finalize(qweight, _PACKED.pop, key, None)
    return hit[1], hit[2]


@functools.cache
def _unsigned_activations() -> bool:
    """Whether oneDNN's int8 GEMM takes the activations as u8 with a zero point of 128. Its
    VNNI kernels multiply u8 by s8 only: s8 activations on a CPU without AMX-INT8 fell to its
    reference loop (`ref_int8`: 0.9 s for a 256 x 576 x 576 GEMM on an AMD EPYC, 2 threads,
    against 0.24 ms for `brg_matmul:avx512_core_vnni` on the shifted codes). AMX multiplies s8
    by s8 as they are, the path measured on an AMX Xeon."""
    return "amx_int8" not in cpu_flags()


def int8_gemm(
    xq: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(xq [M, K] int8 @ qweight [N, K] int8 ^ T) * scales [N] (fp32), in `out_dtype`: the
    products summed exactly in int32, scaled and rounded once. xq uint8: the codes + 128
    (`quantize_input(..., u8=True)`), what the VNNI kernels take without a pass of their own."""
    if not w8a8_supported():
        raise RuntimeError(f"int8_gemm {UNSUPPORTED}")
    packed, zeros = _packed(qweight)
    x, zero_point = xq.contiguous(), 0
    shifted = x.dtype == torch.uint8
    if _unsigned_activations():  # v + 128 for every int8 v: its sign bit flipped, read as u8
        x = x if shifted else x.view(torch.uint8).bitwise_xor(0x80)
        zero_point = 128
    elif shifted:
        x = x.bitwise_xor(0x80).view(torch.int8)
    return torch.ops.onednn.qlinear_pointwise(
        x, 1.0, zero_point, packed, scales, zeros, None, 1.0, 0, out_dtype, "none", [], ""
    )


# the operator calls `int8_gemm` through this module's namespace (looked up at each call)
def _w8a8_mm(
    xq: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    return int8_gemm(xq, qweight, scales, out_dtype)


def _w8a8_mm_meta(
    xq: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    return xq.new_empty(xq.shape[0], qweight.shape[0], dtype=out_dtype)


# the operator calls `quantize_input` through this module's namespace (looked up at each call)
def _w8a8_quant(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    in_scale: torch.Tensor | None,
    eps: float,
    kind: str,
    u8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_input(x, weight, in_scale, eps, kind, u8)


def _w8a8_quant_meta(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    in_scale: torch.Tensor | None,
    eps: float,
    kind: str,
    u8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[1] // 2 if kind == "silu_mul" else x.shape[1]
    codes = x.new_empty(x.shape[0], n, dtype=torch.uint8 if u8 else torch.int8)
    return codes, x.new_empty(x.shape[0], 1, dtype=torch.float32)


def _u8_codes(x: torch.Tensor) -> bool:
    """Whether a linear's input codes come as u8 from the quantization pass: where the GEMM
    takes u8 (no AMX-INT8) and the C ops run (`cpu_native.elementwise`)."""
    return cpu_native.elementwise(x) and _unsigned_activations()


def rescale(y: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An int8 GEMM's output times its rows' activation scales sx [rows, 1], in `dtype`:
    `(y.float() * sx).to(dtype)`; a bf16 y on CPU in place through one C pass, the same bits
    (`cpu_native.scale_rows_`)."""
    if y.dtype == dtype and cpu_native.elementwise(y):
        return cpu_native.scale_rows_(y, sx)
    return (y.float() * sx).to(dtype)


define_op(
    "w8a8_mm(Tensor xq, Tensor qweight, Tensor scales, ScalarType out_dtype) -> Tensor",
    cpu=_w8a8_mm,
    meta=_w8a8_mm_meta,
)
define_op(
    "w8a8_quant(Tensor x, Tensor? weight, Tensor? in_scale, float eps, str kind, bool u8=False) "
    "-> (Tensor, Tensor)",
    cpu=_w8a8_quant,
    meta=_w8a8_quant_meta,
)


class W8A8Linear(nn.Module):
    """y = x W^T (+ bias) with x quantized per row and W int8 per output channel.

    Except in the frozen decode graphs of a bf16 model on an AMX CPU (`frozen_graphs`): there
    the weight-only packed kernel, which inductor replaces by its AMX template, as a weight-only
    int8 layer does. Measured on many-short's batch-128 decode steps (embedded model, 2
    threads): 36.7 ms a step through the template, 41.4 through the int8 GEMM (its 121 GEMMs
    17.7 ms, the activations' quantization and the operator calls the rest; measured again with
    the fused input quantization: a many-short run's 15 decode steps 665-709 ms through the int8
    GEMM against 648-659 through the template). A w8a8 model's lm_head is weight-only int8
    (`quantization.apply`): the logits come from bf16 activations."""

    def __init__(self, w: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = w.q.shape
        self.register_buffer("qweight", w.q.contiguous())
        self.register_buffer("scales", w.scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.dtype = dtype
        self.packed_when_frozen = dtype == torch.bfloat16 and amx_tiles()
        # the frozen decode graphs' template is autotuned per class of row counts (`row_bounds`):
        # one graph for every batch from 2 was autotuned at 2 rows, where ATen's GEMV wins
        # (gate / up and down at batch 128: 2.1 ms a call against 0.26 through the template)
        self.row_thresholds = (linear.DEQUANT_MIN_ROWS,) if self.packed_when_frozen else ()
        # the packed kernel's scales, in the activation dtype
        self.register_buffer("scales_act", w.scale.to(dtype) if self.packed_when_frozen else None)
        self.norm: RMSNorm | None = None  # the RMSNorm of the input, once folded in
        _packed(self.qweight)  # at load: no packing in the first steps

    def fold_norm(self, norm: RMSNorm) -> None:
        """Take the RMSNorm that forms this layer's input: its caller passes the un-normed
        rows, and the norm and the quantization are one pass (`quantize_input`, "rmsnorm")."""
        self.norm = norm

    def templated(self) -> bool:
        """Whether this call runs the weight-only packed kernel (frozen decode graphs on AMX)."""
        return linear.frozen_graph() and self.packed_when_frozen

    def quantize(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 codes (u8 where `_u8_codes`) and per-row scales of this layer's input rows
        (normed if folded)."""
        norm, u8 = self.norm, _u8_codes(x2)
        if norm is None:
            return torch.ops.minisgl.w8a8_quant(x2, None, None, 0.0, "rows", u8)
        return torch.ops.minisgl.w8a8_quant(x2, norm.weight, None, norm.eps, "rmsnorm", u8)

    def gemm(self, xq: torch.Tensor) -> torch.Tensor:
        """The int8 GEMM of codes, weight scales applied, the rows' scales not."""
        return torch.ops.minisgl.w8a8_mm(xq, self.qweight, self.scales, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = linear.as_rows(x, self.dtype)
        if self.templated():
            if self.norm is not None:
                x2 = self.norm(x2)
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales_act)
        else:
            xq, sx = self.quantize(x2)
            y = rescale(self.gemm(xq), sx, self.dtype)
        return linear.as_output(y, self.bias, x)


class W8A8MLP(nn.Module):
    """The MLP of a w8a8 decoder layer: gate/up, SiLU(gate) x up, down, where the SiLU x up
    rows are formed and quantized in one pass from gate/up's int8 GEMM output, its per-row
    activation scale applied there (`quantize_input`, "silu_mul"): no float SiLU x up tensor,
    no separate rescale. Its gate/up layer usually holds the layer's post-attention norm
    (`W8A8Linear.fold_norm`). Measured (many-short, 2 threads, AMX Xeon): inductor's fused loop
    of the rescale, SiLU x up and the quantization took 2.6 ms a [2587, 2 x 1536] call (156 ms
    of a 1.48 s run), the C pass 1.2-1.5 ms alone."""

    def __init__(self, gate_up_proj: W8A8Linear, down_proj: W8A8Linear) -> None:
        super().__init__()
        if gate_up_proj.bias is not None or gate_up_proj.out_features % 2:
            raise ValueError("W8A8MLP: gate/up must have no bias and an even number of rows")
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        self.intermediate_size = gate_up_proj.out_features // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu, down = self.gate_up_proj, self.down_proj
        if gu.templated():  # the frozen decode graphs' weight-only kernels, as an MLP
            gate, up = gu(x).split(self.intermediate_size, dim=-1)
            return down(F.silu(gate) * up)
        x2 = linear.as_rows(x, gu.dtype)
        xq, sx = gu.quantize(x2)
        gate_up = gu.gemm(xq)
        hq, sh = torch.ops.minisgl.w8a8_quant(gate_up, None, sx, 0.0, "silu_mul",
                                              _u8_codes(gate_up))  # fmt: skip
        y = rescale(down.gemm(hq), sh, down.dtype)
        return linear.as_output(y, down.bias, x)
