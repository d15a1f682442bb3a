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
from torch import nn

from minisgl.quantization import linear
from minisgl.quantization.packed import Int8Weight
from minisgl.utils.cpu import cpu_flags

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


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> int8 [M, K] and fp32 scales [M, 1]: scale = max |row| / 127, each value
    rounded to nearest (ties to even) of x / scale. A zero row gets a tiny scale and zeros."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(xf / scale).clamp(-127, 127).to(torch.int8), scale


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
    products summed exactly in int32, scaled and rounded once."""
    packed, zeros = _packed(qweight)
    x, zero_point = xq.contiguous(), 0
    if _unsigned_activations():  # v + 128 for every int8 v: its sign bit flipped, read as u8
        x, zero_point = x.view(torch.uint8).bitwise_xor(0x80), 128
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


_LIB = torch.library.Library("minisgl", "FRAGMENT")
_LIB.define("w8a8_mm(Tensor xq, Tensor qweight, Tensor scales, ScalarType out_dtype) -> Tensor")
_LIB.impl("w8a8_mm", _w8a8_mm, "CPU")
_LIB.impl("w8a8_mm", _w8a8_mm_meta, "Meta")


class W8A8Linear(nn.Module):
    """y = x W^T (+ bias) with x quantized per row and W int8 per output channel.

    Except in the frozen decode graphs of a bf16 model on an AMX CPU (`frozen_graphs`): there
    the weight-only packed kernel, which inductor replaces by its AMX template, as a weight-only
    int8 layer does. Measured on many-short's batch-128 decode steps (embedded model, 2
    threads): 36.7 ms a step through the template, 41.4 through the int8 GEMM (its 121 GEMMs
    17.7 ms, the activations' quantization and the operator calls the rest). The lm_head is the
    exception (`template_when_frozen=False`): its 128 x 49152 x 576 GEMM took 2.9 ms through
    the int8 GEMM (+0.7 ms for the per-row rescale) against 4.5-5.8 ms through the template."""

    def __init__(
        self,
        w: Int8Weight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        template_when_frozen: bool = True,
    ) -> None:
        """`template_when_frozen=False`: the int8 GEMM in the frozen decode graphs too."""
        super().__init__()
        self.out_features, self.in_features = w.q.shape
        self.register_buffer("qweight", w.q.contiguous())
        self.register_buffer("scales", w.scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.dtype = dtype
        amx = dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported()
        self.packed_when_frozen = template_when_frozen and amx
        # the frozen decode graphs' template is autotuned per class of row counts (`row_bounds`):
        # one graph for every batch from 2 was autotuned at 2 rows, where ATen's GEMV wins
        # (gate / up and down at batch 128: 2.1 ms a call against 0.26 through the template)
        self.row_thresholds = (linear.DEQUANT_MIN_ROWS,) if self.packed_when_frozen else ()
        # the packed kernel's scales, in the activation dtype
        self.register_buffer("scales_act", w.scale.to(dtype) if self.packed_when_frozen else None)
        _packed(self.qweight)  # at load: no packing in the first steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = linear.as_rows(x, self.dtype)
        if linear.frozen_graph() and self.packed_when_frozen:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales_act)
        else:
            xq, sx = quantize_rows(x2)
            y = torch.ops.minisgl.w8a8_mm(xq, self.qweight, self.scales, self.dtype)
            y = (y.float() * sx).to(self.dtype)
        return linear.as_output(y, self.bias, x)
