"""The batch-invariant bf16 GEMM on AMX tiles (`amx_gemm.c`): weights packed once into its
tile layout (`AmxWeight`), then `y = x w^T + bias` with a row's bits independent of the other
rows of the call (deterministic mode)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from minisgl.kernels.cpu import _ERRORS, _library, step_layers
from minisgl.utils.cpu import cpu_flags

K_TILE, N_TILE = 32, 16  # a B tile: 32 values of k (16 pairs) by 16 columns


@functools.cache
def supported() -> bool:
    """The kernel runs here: built with AMX-BF16 (`-march=native` on such a CPU) and the tile
    state granted by Linux."""
    lib = _library()
    return lib is not None and "amx_bf16" in cpu_flags() and bool(lib.amx_gemm_supported())


@dataclass(frozen=True)
class AmxWeight:
    """w [n, k] bf16 packed as the kernel reads it: n padded to 16, [n / 16][k / 32][16][16][2]
    (B tile (t, c) holds columns 16 t.., k 32 c..; its row p the pair of k (2 p, 2 p + 1) of
    the 16 columns), and the bias [n] (bf16) or None."""

    packed: torch.Tensor
    n: int
    k: int
    bias: torch.Tensor | None

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> AmxWeight:
        n, k = weight.shape
        if k % K_TILE:
            raise ValueError(f"AmxWeight: in_features {k} is not a multiple of {K_TILE}")
        w = weight.detach().to(torch.bfloat16)
        n_pad = -(-n // N_TILE) * N_TILE
        if n_pad != n:
            w = torch.cat([w, w.new_zeros(n_pad - n, k)])
        packed = w.view(n_pad // N_TILE, N_TILE, k // K_TILE, K_TILE // 2, 2)
        packed = packed.permute(0, 2, 3, 1, 4).contiguous()
        b = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()
        return cls(packed, n, k, b)


def amx_gemm(x: torch.Tensor, w: AmxWeight) -> torch.Tensor:
    """bf16 x [rows, k] (rows >= 0, unit stride within a row) times w^T + bias: bf16 [rows, n],
    each row's sums its own (k ascending in tiles of 32, fp32), the bias added, rounded once."""
    lib = _library()
    assert lib is not None
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != w.k or x.stride(1) != 1:
        raise ValueError(f"amx_gemm: x {tuple(x.shape)} {x.dtype} for a [{w.n}, {w.k}] weight")
    rows = x.shape[0]
    out = torch.empty(rows, w.n, dtype=torch.bfloat16)
    if rows == 0:
        return out
    n_pad = w.packed.shape[0] * N_TILE
    rc = lib.amx_gemm_bf16(x.data_ptr(), x.stride(0), w.packed.data_ptr(),
                           step_layers.ptr(w.bias), out.data_ptr(), rows, w.n, n_pad, w.k,
                           torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise ValueError(f"amx_gemm: {_ERRORS.get(rc, rc)}")
    return out
