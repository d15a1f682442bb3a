"""A CPU without native bf16 (no AVX512-BF16, no AMX: the x86-avx2 kind, an AMD EPYC of the Zen 3
kind) runs the embedded int4 model in bf16 as the others do, its GEMMs in fp32.

Measured there (2 cores, embedded model): `dtype="auto"` chose fp32 for want of native bf16, so
the C decode step (bf16 only) never ran and every linear took `_weight_int4pack_mm_for_cpu` with
fp32 activations, 1.4 ms a call: single stream 5.6 tok/s against llama.cpp's 136. In bf16 the C
step's plain loops ran 38 tok/s, but a 500-token prefill took 5.6 s against 1.1 in fp32: the
de-quantized GEMM in bf16 is emulated by oneDNN there (46 ms a linear)."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from minisgl.engine import memory
from minisgl.kernels import cpu as cpu_native
from minisgl.quantization import linear
from minisgl.quantization.linear import Int4Linear
from minisgl.quantization.packed import quantize_int4

CPU = torch.device("cpu")
CFG = types.SimpleNamespace(torch_dtype="bfloat16")


def test_auto_picks_bf16_for_int4_models_wherever_the_c_kernels_build(monkeypatch):
    monkeypatch.setattr(memory, "cpu_has_fast_bf16", lambda: False)
    c_step = cpu_native.available(torch.bfloat16)
    assert memory.resolve_dtype("auto", CFG, CPU, "int4") == (
        torch.bfloat16 if c_step else torch.float32
    )
    assert memory.resolve_dtype("auto", CFG, CPU, "int8") == torch.float32
    assert memory.resolve_dtype("auto", CFG, CPU, "none") == torch.float32
    monkeypatch.setattr(memory, "cpu_has_fast_bf16", lambda: True)
    assert memory.resolve_dtype("auto", CFG, CPU, "int8") == torch.bfloat16


def test_a_bf16_layer_without_native_bf16_multiplies_in_fp32(monkeypatch):
    """The de-quantized GEMM of a bf16 layer there: the bf16 values widened, one fp32 GEMM, the
    sums rounded once to bf16 (as a native bf16 GEMM rounds its fp32 sums)."""
    monkeypatch.setattr(linear, "native_bf16", lambda: False, raising=False)
    g = torch.Generator().manual_seed(2)
    layer = Int4Linear(quantize_int4(torch.randn(160, 192, generator=g)), None, torch.bfloat16)
    x = torch.randn(layer.dequant_min_rows + 5, 192, generator=g).bfloat16()
    seen: list[torch.dtype] = []
    real = F.linear

    def spy(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(a.dtype)
        return real(a, w, b)

    monkeypatch.setattr(F, "linear", spy)
    out = layer(x)
    assert seen == [torch.float32], seen
    want = real(x.float(), layer.dequantize().float()).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
