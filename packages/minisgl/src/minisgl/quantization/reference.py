"""The float reference of a quantized model: an HF model carrying the weights minisgl serves.

`fake_quantize_hf(model, method)` rounds every decoder linear of a transformers Llama-family
model through `method` and back, and the lm_head (with the embedding when tied) through int8,
as `apply.quantize_model` does (int4 mode: the lm_head int4 from those int8 rows): HF then computes with exactly the de-quantized weights the
packed kernels read, which separates kernel error from quantization error in parity checks.
"""

from __future__ import annotations

import torch

from minisgl.quantization.linear import int4_supported
from minisgl.quantization.packed import quantize_int4, quantize_int8

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@torch.no_grad()
def fake_quantize_hf(model: torch.nn.Module, method: str) -> torch.nn.Module:
    for module in model.model.layers.modules():
        for leaf in _LINEARS:
            lin = getattr(module, leaf, None)
            if not isinstance(lin, torch.nn.Linear):
                continue
            use = method
            if use == "int4" and not int4_supported(lin.out_features, lin.in_features):
                use = "int8"
            q = quantize_int4(lin.weight) if use == "int4" else quantize_int8(lin.weight)
            lin.weight.copy_(q.dequantize())
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
