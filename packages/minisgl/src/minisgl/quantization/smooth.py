"""SmoothQuant for W8A8 (card P2-004): move activation outliers into the weights, at load.

A linear's input x and weight W give the same product as x / s and W * s for any positive
per-input-channel factors s. With s = max|x|^alpha / max|W|^(1 - alpha) (channel maxima of x
from a calibration forward, of W over its output rows) the activations' outlier channels shrink
and the weights' grow, so both quantize to int8 with less error (the embedded model in w8a8:
perplexity 38.51 without smoothing, 36.84-36.91 with alpha 0.5, fp32 37.50; alpha 0.7 gave
39.34 and lost its "Paris"; on ten texts: `ALPHA`). The 1 / s is folded into the weights that produce x, so nothing
changes at run time:
- QKV's input: the input RMSNorm's weight;
- gate / up's input: the post-attention RMSNorm's weight;
- down's input (SiLU(gate) * up): the up rows of gate_up.
o_proj's input (the attention output) is not smoothed: its factors would have to be shared by
the query heads of each KV head to fold into the V rows.

Calibration (`channel_maxima`) runs the float model over a fixed text (`CALIBRATION_TEXT`, not
the benchmark's perplexity text) without an engine: `float_logits` attends causally through
SDPA, one sequence, no sliding window (the text is shorter than any window).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.models.llama import DecoderLayer

# Measured on the embedded model as the geometric mean of the perplexity over ten texts
# (`cpu_speed.PPL_TEXTS`; fp32 17.78; AMD EPYC, whose int8 GEMM sums exactly as AMX's does):
# alpha 0.35 18.33 (+3.1%), 0.5 (SmoothQuant's default) 18.25 (+2.6%), 0.6 18.11 (+1.9%),
# 0.65 18.04 (+1.5%), 0.7 18.30 (+2.9%, no "Paris"). 0.6 sits between the best measured and
# the default, each of its neighbours still answers "Paris".
ALPHA = 0.6
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
CALIBRATION_TEXT = (
    "Photosynthesis converts light energy into chemical energy stored in sugars. In "
    "chloroplasts, chlorophyll absorbs mostly red and blue light and reflects green. "
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "Q: What is the tallest mountain on Earth? A: Mount Everest, 8,849 metres above sea level. "
    "Dear team, the quarterly report is attached; revenue grew 12% while costs fell by 3%. "
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n"
    "Red leaves drift and fall,\ncool wind hums through empty fields,\nthe year exhales slow."
    "<|im_end|>\n<|im_start|>user\nExplain how a bicycle gear works in two sentences.<|im_end|>"
    "\n<|im_start|>assistant\nA small front gear and a large rear gear make pedalling easy but "
    "slow; a large front gear and a small rear one turn the wheel further with every stroke."
)


class _CausalAttention:
    """The `backend.forward` of `DecoderLayer.around_attention` for one whole sequence."""

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: None
    ) -> torch.Tensor:
        t, h, d = q.shape
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            enable_gqa=h != k.shape[1],
        )  # fmt: skip
        return o.transpose(0, 1).reshape(t, h * d)


@torch.no_grad()
def float_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """[T, vocab] logits of every position of `ids`, one causal forward without an engine."""
    tokens = torch.tensor(ids, device=model.lm_head.weight.device)
    x = model.model.embed_tokens(tokens)
    cos_sin = model.rotary(torch.arange(len(ids), device=tokens.device))
    backend = _CausalAttention()
    for layer in model.model.layers:
        x = layer.around_attention(
            x, cos_sin, backend, None, DecoderLayer.pre_attention, DecoderLayer.post_attention
        )
    return model.lm_head(model.model.norm(x)).float()


def _linear(layer: nn.Module, rel: str) -> nn.Linear:
    parent, leaf = rel.split(".")
    return getattr(getattr(layer, parent), leaf)


def channel_maxima(model: nn.Module, ids: list[int]) -> dict[str, torch.Tensor]:
    """{"model.layers.{i}.{linear}": fp32 [in_features] max |input| over the tokens of `ids`}
    for the four linears of every decoder layer, from one `float_logits` pass."""
    maxima: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def record(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float().abs().amax(dim=0)
            maxima[name] = x if name not in maxima else torch.maximum(maxima[name], x)

        return record

    handles = [
        _linear(layer, rel).register_forward_pre_hook(hook(f"model.layers.{i}.{rel}"))
        for i, layer in enumerate(model.model.layers)
        for rel in LINEARS
    ]
    try:
        float_logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    return maxima


def _factors(x_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    w_max = torch.cat([w.detach().float() for w in weights]).abs().amax(dim=0)
    s = x_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


@torch.no_grad()
def smooth_model(model: nn.Module, maxima: dict[str, torch.Tensor], alpha: float = ALPHA) -> None:
    """Fold SmoothQuant factors into the float model's weights in place (see the module
    docstring); the model computes the same function (up to rounding in its dtype)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothing alpha must be in [0, 1], got {alpha}")
    for i, layer in enumerate(model.model.layers):
        name = f"model.layers.{i}."
        qkv, gate_up, down = (_linear(layer, r) for r in LINEARS if r != "self_attn.o_proj")
        inter = gate_up.out_features // 2
        s_qkv = _factors(maxima[name + "self_attn.qkv_proj"], [qkv.weight], alpha)
        s_gu = _factors(maxima[name + "mlp.gate_up_proj"], [gate_up.weight], alpha)
        s_down = _factors(maxima[name + "mlp.down_proj"], [down.weight], alpha)
        _scale(layer.input_layernorm.weight, 1 / s_qkv)
        _scale(qkv.weight, s_qkv[None, :])
        _scale(layer.post_attention_layernorm.weight, 1 / s_gu)
        _scale(gate_up.weight, s_gu[None, :])
        _scale(gate_up.weight[inter:], 1 / s_down[:, None])
        _scale(down.weight, s_down[None, :])


def _scale(param: torch.Tensor, by: torch.Tensor) -> None:
    """param *= by, computed in fp32 and rounded once to the param's dtype."""
    param.copy_(param.float() * by)


def calibrate_and_smooth(model: nn.Module, model_path: str | Path, max_positions: int) -> None:
    """`smooth_model` with the channel maxima of `CALIBRATION_TEXT` (through the model folder's
    tokenizer, at most `max_positions` tokens)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_path)).encode(CALIBRATION_TEXT)
    smooth_model(model, channel_maxima(model, ids[:max_positions]))
