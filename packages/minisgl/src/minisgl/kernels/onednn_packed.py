"""bf16 linears whose weights are laid out once for oneDNN (a CPU with AMX tiles).

`F.linear` on bf16 CPU tensors runs oneDNN, which re-lays the weight out for its AMX kernel on
every call. Laid out once at load (`mkldnn._reorder_linear_weight`, as inductor's freezing
does) and multiplied by `mkldnn._linear_pointwise`, the embedded model's GEMMs at 128 rows (a
many-short decode step) ran 1.5x faster (gate/up [1536 x 576]: 0.117 against 0.184 ms) and its
lm_head [49152 x 576] 2.1x (4.0 against 8.4 ms), the same bits as `F.linear` at 1, 3 and 128
rows; prefill's 2,586 rows gained nothing (intel-amx, 2 threads). vLLM's CPU build packs its
weights the same way. Without AMX tiles (or with `MINISGL_ONEDNN_PACKED=0`, or an ISA level
below them) the layers stay `nn.Linear`.
"""

from __future__ import annotations

import os

import torch
from torch import nn

ENV = "MINISGL_ONEDNN_PACKED"
ROWS_HINT = 128  # the row count oneDNN lays the weight out for (any row count runs)


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bf16 linears on `device` get packed weights: a CPU with AMX tiles at the ISA
    level in force, oneDNN built in, and not turned off by `MINISGL_ONEDNN_PACKED=0`."""
    from minisgl.utils.cpu import amx_tiles

    if os.environ.get(ENV, "1") == "0":
        return False
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and amx_tiles()


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward on a weight laid out for oneDNN (an opaque mkldnn tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
        self.register_buffer("packed", packed)
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Every bf16 `nn.Linear` of the decoder layers' attention and dense MLP, and the lm_head,
    replaced by a `PackedLinear` (a tied lm_head's weight stays with the embedding, which reads
    it; a MoE block's router and experts stay); the number replaced."""
    places = [(model, "lm_head")]
    for layer in model.model.layers:
        places += [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj")]
        places += [(layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")]  # dense MLPs only
    n = 0
    for parent, name in places:
        child = getattr(parent, name, None)
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
            setattr(parent, name, PackedLinear(child.weight, child.bias))
            n += 1
    return n
