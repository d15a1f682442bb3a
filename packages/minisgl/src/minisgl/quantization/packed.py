"""Quantized weights in their portable (on-disk) form, and the conversions into it.

`Int8Weight`: int8 [N, K] with one scale per output channel, w = q * scale.
`Int4Weight`: 4-bit codes 0..15 stored two per byte as uint8 [N, K/2] (low nibble first), one
scale and zero per group of `INT4_GROUP` inputs, w = (q - 8) * scale + zero: the convention of
PyTorch's `_weight_int4pack_mm_for_cpu`, so GGUF Q4_1 blocks (w = d * q + m) map exactly with
scale = d and zero = m + 8 d. The kernel-specific tiling is applied at load time only
(`linear.py`): it depends on the CPU's instruction set, the cache must not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.quantization import INT4_GROUP


@dataclass(frozen=True)
class Int8Weight:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N]

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


@dataclass(frozen=True)
class Int4Weight:
    q: torch.Tensor  # uint8 [N, K // 2], two codes per byte (low nibble = even column)
    scale: torch.Tensor  # float32 [N, K // INT4_GROUP]
    zero: torch.Tensor  # float32 [N, K // INT4_GROUP]

    def codes(self) -> torch.Tensor:
        """The codes as int32 [N, K], values 0..15."""
        lo, hi = (self.q & 0x0F).int(), (self.q >> 4).int()
        return torch.stack((lo, hi), dim=-1).view(self.q.shape[0], -1)

    def dequantize(self) -> torch.Tensor:
        codes = self.codes().float()
        scale = self.scale.repeat_interleave(INT4_GROUP, dim=1)
        zero = self.zero.repeat_interleave(INT4_GROUP, dim=1)
        return (codes - 8) * scale + zero


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 (round to nearest)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


def quantize_int4(w: torch.Tensor) -> Int4Weight:
    """Asymmetric group-wise int4 (min/max per group of INT4_GROUP inputs, round to nearest)."""
    w = w.float()
    n, k = w.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}, got {k}")
    g = w.view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-10)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return Int4Weight(pack_nibbles(codes.view(n, k)), scale, lo + 8 * scale)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15) -> uint8 [N, K/2], low nibble = even column."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def concat_int8(parts: list[Int8Weight]) -> Int8Weight:
    return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))


def concat_int4(parts: list[Int4Weight]) -> Int4Weight:
    return Int4Weight(
        torch.cat([p.q for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.cat([p.zero for p in parts]),
    )
