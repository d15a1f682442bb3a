"""A MoE block's experts with weight-only int8 / int4 weights: each expert's gate/up and down
projections an `Int8Linear` / `Int4Linear` (int4 where its shape allows, else int8, as the dense
linears), quantized from the loaded float weights; the tokens are grouped by expert as the float
`Experts` group them (`models.moe.run_experts`). The router stays float: its top-k decides
which experts run, and it is small ([E, H])."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.models.moe import Experts, run_experts
from minisgl.quantization.linear import Int4Linear, Int8Linear, int4_supported
from minisgl.quantization.packed import quantize_int4, quantize_int8


def _packed(w: torch.Tensor, method: str, dtype: torch.dtype) -> Int4Linear | Int8Linear:
    if method == "int4" and int4_supported(*w.shape):
        return Int4Linear(quantize_int4(w), None, dtype)
    return Int8Linear(quantize_int8(w), None, dtype)


class QuantizedExperts(nn.Module):
    def __init__(self, experts: Experts, method: str, dtype: torch.dtype) -> None:
        """`experts`' float weights packed by `method` (int8 or int4), activations in `dtype`."""
        super().__init__()
        if method not in ("int8", "int4"):
            raise ValueError(f"experts quantize to int8 or int4, not {method!r}")
        with torch.no_grad():
            gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
            self.gate_up_proj = nn.ModuleList(_packed(w, method, dtype) for w in gate_up)
            self.down_proj = nn.ModuleList(_packed(w, method, dtype) for w in down)

    @property
    def num_experts(self) -> int:
        return len(self.gate_up_proj)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj[e](x).chunk(2, dim=-1)
        return self.down_proj[e](F.silu(gate) * up)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        return run_experts(x, weights, experts, self.num_experts, self.expert)
