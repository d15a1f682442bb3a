"""The int4 GEMM of the C decode step (`kernels/cpu/decode_step.c`) gives a row the same bits
whatever other rows share the call, from 2 rows on: each (weight row, input row) sum runs the
same operations in the same order in every tile shape, and its horizontal reduction is the one
of its weight row's position. A verify step of speculative decoding (k + 1 rows of a request)
and a batched decode step therefore compute each row as any other multi-row step would. One
row alone runs the bandwidth-bound single-stream kernel, whose accumulation differs."""

from __future__ import annotations

import pytest
import torch

from minisgl.testing.modules import require_module

pytestmark = pytest.mark.isa_paths


def _matrix(n: int, k: int, seed: int):
    from minisgl.quantization.packed import quantize_int4

    g = torch.Generator().manual_seed(seed)
    w4 = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
    scales_zeros = torch.stack((w4.scale.t(), w4.zero.t()), dim=-1).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    return require_module("minisgl.kernels.cpu.int4").Int4Matrix.of(w4.q, scales_zeros, bias)


@pytest.mark.parametrize(("n", "k"), [(64, 64), (67, 160), (200, 576), (13, 1536), (258, 96)])
def test_a_row_has_the_same_bits_at_every_row_count_from_two(n: int, k: int) -> None:
    int4 = require_module("minisgl.kernels.cpu.int4")
    w = _matrix(n, k, seed=n + k)
    x = (torch.randn(24, k, generator=torch.Generator().manual_seed(k)) * 3).bfloat16()
    full = int4.int4_gemv(x, w)
    for rows in range(2, 18):
        for start in (0, 1, 5):
            got = int4.int4_gemv(x[start : start + rows], w)
            want = full[start : start + rows]
            assert torch.equal(got, want), (rows, start, (got.float() - want.float()).abs().max())
