"""The float reference of a quantized model: an HF model carrying the weights minisgl serves.

`fake_quantize_hf(model, method)` rounds every decoder linear of a transformers Llama-family
model (and each expert's matrices of a MoE block) through `method` and back, and the lm_head (with the embedding when tied) through int8,
as `apply.quantize_model` does (int4 mode: the lm_head int4 from those int8 rows): HF then computes with exactly the de-quantized weights the
packed kernels read, which separates kernel error from quantization error in parity checks.
"""

from __future__ import annotations

import torch

from minisgl.quantization.linear import int4_supported
from minisgl.quantization.packed import quantize_int4, quantize_int8

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_EXPERTS = ("gate_up_proj", "down_proj")  # a MoE block's stacked [E, N, K] expert weights


def _rounded(w: torch.Tensor, method: str) -> torch.Tensor:
    use = method
    if use == "int4" and not int4_supported(*w.shape):
        use = "int8"
    return (quantize_int4(w) if use == "int4" else quantize_int8(w)).dequantize()


@torch.no_grad()
def fake_quantize_hf(model: torch.nn.Module, method: str) -> torch.nn.Module:
    for module in model.model.layers.modules():
        for leaf in _LINEARS:
            lin = getattr(module, leaf, None)
            if isinstance(lin, torch.nn.Linear):
                lin.weight.copy_(_rounded(lin.weight, method))
        for leaf in _EXPERTS:  # each expert's matrix as its own linear (`QuantizedExperts`)
            w = getattr(module, leaf, None)
            if isinstance(w, torch.nn.Parameter) and w.dim() == 3:
                for e in range(w.shape[0]):
                    w[e].copy_(_rounded(w[e], method))
    head = model.lm_head.weight
    head8 = quantize_int8(head).dequantize()
    n, k = head.shape
    if method == "int4" and int4_supported(n, k):
        head4 = quantize_int4(head8).dequantize()
        emb = model.model.embed_tokens
        if emb.weight is head:  # tied: the lookup keeps the int8 rows
            emb.weight = torch.nn.Parameter(head8, requires_grad=False)
            model.lm_head.weight = torch.nn.Parameter(head4, requires_grad=False)
        else:
            head.copy_(head4)
    else:
        head.copy_(head8)  # tied: the embedding is this tensor
    return model
