"""Weight-only quantized layers on PyTorch's packed CPU kernels.

`_weight_int8pack_mm` (int8 per channel) and `_weight_int4pack_mm_for_cpu` (int4 per group of
32) read the packed weights as they are and de-quantize in registers; both want their scales in
the activation dtype, and both are fast with bf16 activations only (fp32 activations take a
scalar fallback, measured 10-30x slower: see docs/runtime.md).

Both are GEMV kernels: their time grows with the row count (2 threads, AMX, bf16: [1077, 576] x
[576, 3072] 23 ms through `_weight_int8pack_mm`, 1.8 ms de-quantized and through `F.linear`;
[4096, 576] x [576, 1536] 39 against 2.6 ms). So from `DEQUANT_MIN_ROWS` rows on (prefill, large
decode batches) an int8 layer multiplies `qweight * scales` in the activation dtype, a temporary
of the call (bf16: one C pass, `cpu_native.dequant_int8`, 0.02-0.09 ms a matrix of the embedded
model against 0.05-0.3 through torch), by one GEMM (oneDNN; MKL in fp32);
below it, the packed kernel reads the int8 bytes as they are. Measured crossover on the
embedded model's shapes: 24-32 rows (at 16 the packed kernel wins, at 32 the GEMM: 0.52 against
0.68 ms for gate/up). The weights are the ones the packed kernel uses (int8 codes times the
scales rounded to the activation dtype): in fp32, exactly HF's on the de-quantized weights.
Int4 layers do the same, bf16 ones from `INT4_C_DEQUANT_MIN_ROWS` (64) with their codes
de-quantized in one C pass (`cpu_native.dequant_int4`: 0.12 ms for gate/up; the GEMM wins from
16 rows for the layers' shapes), others from `INT4_DEQUANT_MIN_ROWS` (256) through torch ops
(nibbles to codes to `(q - 8) * scale + zero` in fp32: 1.5 ms for gate/up; a batch-128 decode
step of the embedded model lost with them, 222 -> 315 ms). They keep their codes as
`Int4Weight` has them (`codes`, uint8 [N, K / 2], low nibble the even column) beside the packed
copy, whose layout is the kernel's own: a second copy of the 4-bit codes. A large layer (the
lm_head) de-quantizes and multiplies a block of rows at a time (`DEQUANT_BLOCK_BYTES`).

On a CPU without native bf16 (no AVX512-BF16 or AMX: the x86-avx2 kind) a bf16 int4 layer
de-quantizes at every row count and widens its operands to one fp32 GEMM, rounding the sums
once (`fp32_gemm`):
oneDNN emulated the bf16 GEMM there, 46 ms a prefill linear of the embedded model, and a
500-token prefill took 5.6 s against 0.97 s widened (AMD EPYC, AVX2 only, 2 threads).

Compiled graphs branch the same way. The row check is a guard there, so the engine keys its
graphs by the layers' `row_thresholds` (`engine/compiled.py`: every graph sees one side of each
threshold, and the start compiles one per class: no compile while serving). The de-quantization
is an operator (`minisgl::int8_dequant`, `minisgl::int4_dequant`) that inductor calls as it is:
freezing would otherwise fold the float weights into constants of the graph, a second copy of
every weight. Except in the decode graphs of a bf16 int8 model on an AMX CPU (`frozen_graphs`):
there the packed kernel at every row count, which inductor turns into its AMX template.

int8 activations (an int8 x int8 GEMM, SmoothQuant-calibrated weights) are their own mode,
`quantization="w8a8"` (`w8a8.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.kernels import cpu as cpu_native
from minisgl.kernels.oplib import define_op
from minisgl.quantization import INT4_GROUP
from minisgl.quantization.packed import Int4Weight, Int8Weight
from minisgl.utils.cpu import amx_tiles, native_bf16

# int8 layers: from this many rows on, one float GEMM on the de-quantized weights
DEQUANT_MIN_ROWS = 32
# int4 layers: the same from this many rows on (torch ops de-quantize: fp32 layers, or no C
# compiler), or from INT4_C_DEQUANT_MIN_ROWS (bf16 layers, `cpu_native.dequant_int4`)
INT4_DEQUANT_MIN_ROWS = 256
INT4_C_DEQUANT_MIN_ROWS = 64
# a layer de-quantizes at most this many bytes of weights at a time (a GEMM a block of output
# features): the heap serves blocks below glibc's 32 MB mmap threshold (`utils/malloc.py`) from
# the same pages every call, where the lm_head's whole 57 MB bf16 copy came from fresh,
# zero-filled pages (~14k page faults a call)
DEQUANT_BLOCK_BYTES = 16 << 20

# set while a graph that freezes the weights is traced or run (`frozen_graphs`)
_FROZEN_GRAPH = False


@contextlib.contextmanager
def frozen_graphs() -> Iterator[None]:
    """Calls inside trace or run graphs that freeze the weights (the compiled decode steps):
    there a bf16 int8 layer on an AMX CPU (`Int8Linear.packed_when_frozen`) calls the packed
    kernel at every row count, which inductor replaces by its AMX weight-only int8 GEMM
    template (the weights a constant it re-packs; `max_autotune`): the int8 bytes are read as
    they are at any batch, no float copy (measured, 2 threads, the embedded model's 30 layers
    at 128 rows alone: 14-17 ms against 20-24 for frozen bf16 weights, ATen's packed kernel
    168 ms; many-short's batch-128 decode step 66-69 -> 37-39 ms). Dynamo guards on the flag:
    a graph traced inside runs inside only."""
    global _FROZEN_GRAPH
    before, _FROZEN_GRAPH = _FROZEN_GRAPH, True
    try:
        yield
    finally:
        _FROZEN_GRAPH = before


def frozen_graph() -> bool:
    """Whether the call is inside a graph that freezes the weights (`frozen_graphs`)."""
    return _FROZEN_GRAPH


class Int8Linear(nn.Module):
    def __init__(self, w: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = w.q.shape
        self.register_buffer("qweight", w.q.contiguous())
        self.register_buffer("scales", w.scale.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.dequant_min_rows = DEQUANT_MIN_ROWS
        self.fp32_gemm = False  # `_dequantized_linear`: int4 layers only
        # in frozen graphs: inductor's AMX template reads the int8 weights at any row count
        self.packed_when_frozen = dtype == torch.bfloat16 and amx_tiles()

    @property
    def row_thresholds(self) -> tuple[int, ...]:
        """The row counts at which `forward` changes kernels."""
        return (self.dequant_min_rows,)

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """[N, K] weights (`rows` of them) in the activation dtype: what the packed kernel
        multiplies."""
        return torch.ops.minisgl.int8_dequant(self.qweight[rows], self.scales[rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = as_rows(x, self.scales.dtype)
        if _FROZEN_GRAPH and self.packed_when_frozen:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        elif x2.shape[0] >= self.dequant_min_rows:
            return as_output(_dequantized_linear(self, x2), None, x)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        return as_output(y, self.bias, x)


class Int4Linear(nn.Module):
    # read by the de-quantized GEMM of large batches only (`benchmark.cpu_speed` byte counts)
    BATCH_ONLY_BUFFERS = ("codes",)
    packed_when_frozen = False  # de-quantizes from `dequant_min_rows` in every graph

    def __init__(self, w: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features = w.q.shape[0]
        self.in_features = w.q.shape[1] * 2
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes().contiguous(), 1)
        sz = torch.stack((w.scale.t(), w.zero.t()), dim=-1)  # [K / group, N, 2]
        self.register_buffer("qweight", packed)
        self.register_buffer("codes", w.q.contiguous())  # the de-quantized GEMM's copy
        self.register_buffer("scales_zeros", sz.to(dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        c_pass = dtype == torch.bfloat16 and cpu_native.available(dtype)  # `dequantize_int4`
        self.dequant_min_rows = INT4_C_DEQUANT_MIN_ROWS if c_pass else INT4_DEQUANT_MIN_ROWS
        # bf16 without native bf16: every row count de-quantizes and multiplies in fp32 (the
        # packed kernel with bf16 activations was slow there, and its prefill of the embedded
        # model lost "Paris" from the answer to the capital of France)
        self.fp32_gemm = dtype == torch.bfloat16 and not native_bf16()
        if self.fp32_gemm:
            self.dequant_min_rows = 1
        # fp32 activations: the packed kernel is torch's scalar loop (~1 s a token of the
        # embedded model); the weights are de-quantized once, in fp32, and every row count
        # is one GEMM on them (fp32 memory for fp32 arithmetic, as the dtype asks)
        self.register_buffer(
            "dense",
            dequantize_int4(self.codes, self.scales_zeros) if dtype == torch.float32 else None,
        )
        if self.dense is not None:
            self.dequant_min_rows = 1

    @property
    def row_thresholds(self) -> tuple[int, ...]:
        """The row counts at which `forward` changes kernels."""
        return (self.dequant_min_rows,)

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """[N, K] weights (`rows` of them) in the activation dtype: what the packed kernel
        multiplies."""
        if self.dense is not None:
            return self.dense[rows]
        return torch.ops.minisgl.int4_dequant(self.codes[rows], self.scales_zeros[:, rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = as_rows(x, self.scales_zeros.dtype)
        if x2.shape[0] >= self.dequant_min_rows:
            return as_output(_dequantized_linear(self, x2), None, x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.qweight, INT4_GROUP, self.scales_zeros
        )
        return as_output(y, self.bias, x)


def _dequantized_linear(layer: Int8Linear | Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """x @ the layer's de-quantized weights^T + its bias (inside the GEMM, in fp32), one GEMM
    a block of at most `DEQUANT_BLOCK_BYTES` of weights. bf16 on a CPU without native bf16:
    the bf16 values widened and one fp32 GEMM, its sums rounded once to bf16 (oneDNN emulated
    the bf16 GEMM there: 46 ms a prefill linear)."""
    n, bias = layer.out_features, layer.bias
    if layer.fp32_gemm:  # widened first: the blocks are sized by the fp32 weights they make
        x, bias = x.float(), None if bias is None else bias.float()
    block = max(64, DEQUANT_BLOCK_BYTES // (layer.in_features * x.element_size()) // 64 * 64)
    if n <= block:
        out = F.linear(x, _fp32_if(layer, layer.dequantize()), bias)
    else:
        parts = []
        for start in range(0, n, block):
            rows = slice(start, min(n, start + block))
            w = _fp32_if(layer, layer.dequantize(rows))
            parts.append(F.linear(x, w, None if bias is None else bias[rows]))
        out = torch.cat(parts, dim=-1)
    return out.bfloat16() if layer.fp32_gemm else out


def _fp32_if(layer: Int8Linear | Int4Linear, w: torch.Tensor) -> torch.Tensor:
    return w.float() if layer.fp32_gemm else w


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 weights times their per-row scales, in the scales' dtype; bf16 in one C pass
    where it builds (torch's int8-times-bf16 loop: ~40 ms a decode step of the embedded model),
    else torch ops."""
    if scales.dtype == torch.bfloat16 and cpu_native.available(torch.bfloat16):
        return cpu_native.dequant_int8(qweight, scales)
    return qweight * scales[:, None]


def dequantize_int4(codes: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """[N, K] weights of int4 codes (uint8 [N, K / 2], low nibble the even column) and scales
    and zeros [K / group, N, 2]: `(code - 8) * scale + zero` in fp32, in the scales' dtype (the
    packed kernel's arithmetic); bf16 in one C pass where it builds, else torch ops."""
    if scales_zeros.dtype == torch.bfloat16 and cpu_native.available(torch.bfloat16):
        return cpu_native.dequant_int4(codes, scales_zeros)
    n = codes.shape[0]
    q = torch.stack((codes & 15, codes >> 4), dim=-1).view(n, -1, INT4_GROUP)
    scale = scales_zeros[..., 0].t().float()[:, :, None]  # [N, K / group, 1]
    zero = scales_zeros[..., 1].t().float()[:, :, None]
    return ((q.float() - 8) * scale + zero).view(n, -1).to(scales_zeros.dtype)


# the operators call the functions above through this module's namespace (looked up at each
# call); their Meta kernels give compile the shape
def _int8_dequant(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return dequantize_int8(qweight, scales)


def _int4_dequant(codes: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    return dequantize_int4(codes, scales_zeros)


def _int8_dequant_meta(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return qweight.new_empty(qweight.shape, dtype=scales.dtype)


def _int4_dequant_meta(codes: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    return codes.new_empty(codes.shape[0], 2 * codes.shape[1], dtype=scales_zeros.dtype)


DEQUANT_OPS = (
    define_op("int8_dequant(Tensor qweight, Tensor scales) -> Tensor",
              cpu=_int8_dequant, meta=_int8_dequant_meta),
    define_op("int4_dequant(Tensor codes, Tensor scales_zeros) -> Tensor",
              cpu=_int4_dequant, meta=_int4_dequant_meta),
)  # fmt: skip


# decode runs ~120 of these per token: skip the no-op reshape / casts (each a dispatch);
# the W8A8 layers (`w8a8.py`) share them
def as_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a 2-D [rows, in_features] matrix in the kernel's activation dtype."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    return x if x.dtype == dtype else x.to(dtype)


def as_output(y: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The kernel's [rows, out] result (+ bias) in x's leading shape and dtype."""
    if bias is not None:
        y += bias
    if x.dim() != 2:
        y = y.view(*x.shape[:-1], y.shape[-1])
    return y if y.dtype == x.dtype else y.to(x.dtype)


class Int8Embedding(nn.Module):
    """Token embedding read from int8 rows (the tied lm_head's weights): row * its scale."""

    def __init__(self, head: Int8Linear) -> None:
        super().__init__()
        self.register_buffer("qweight", head.qweight)  # the same tensors, not copies
        self.register_buffer("scales", head.scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.qweight).to(self.scales.dtype)
        return rows * self.scales[ids][:, None]


def int4_supported(out_features: int, in_features: int) -> bool:
    return in_features % INT4_GROUP == 0 and out_features % 8 == 0
