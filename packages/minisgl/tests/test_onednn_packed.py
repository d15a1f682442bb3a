"""bf16 linears with their weights laid out once for oneDNN (`kernels/onednn_packed.py`): on a
CPU with AMX tiles a bf16 model's decoder linears and lm_head are `PackedLinear`, whose
products are `F.linear`'s to the last bit at every row count; elsewhere (no AMX tiles, an
ISA level below them, `MINISGL_ONEDNN_PACKED=0`, deterministic mode, compiled graphs) the
layers stay as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minisgl import LLM
from minisgl.kernels import onednn_packed
from minisgl.kernels.onednn_packed import PackedLinear

CPU = torch.device("cpu")
HERE = onednn_packed.available(torch.bfloat16, CPU)
needs_amx = pytest.mark.skipif(not HERE, reason="oneDNN packing needs AMX tiles (intel-amx)")


def _within_one_bf16_ulp(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """`y` is `F.linear`'s product but for its last bit (bf16 holds 8 bits: an ulp is at most
    2^-7 of the value): the two calls may sum in another order before the one rounding."""
    ref = F.linear(x, w).float()
    got = y.float()
    bound = 2.0**-7 * torch.maximum(ref.abs(), got.abs())
    assert ((got - ref).abs() <= bound).all()


@needs_amx
@pytest.mark.parametrize("rows", [1, 3, 16, 33, 128, 300])
def test_a_packed_linear_gives_f_linears_products(rows):
    torch.manual_seed(rows)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(2, rows, 64, dtype=torch.bfloat16)
    packed = PackedLinear(w, None)
    y = packed(x)
    assert y.shape == (2, rows, 96) and y.dtype == torch.bfloat16
    _within_one_bf16_ulp(y, x, w)
    # with a bias, on a strided input: within two roundings of the exact sum (`F.linear` adds
    # a bf16 bias to its rounded product; the packed call adds it before its one rounding)
    strided = x[:, ::2]
    exact = F.linear(strided.float(), w.float(), b.float())
    size = F.linear(strided.float().abs(), w.float().abs(), b.float().abs())
    bound = 2.0**-7 * size + strided.shape[-1] * 2.0**-23 * size
    for got in (PackedLinear(w, b)(strided), F.linear(strided, w, b)):
        assert ((got.float() - exact).abs() <= bound).all()


def _linears(llm: LLM) -> list[type]:
    model = llm.engine.model
    layer = model.model.layers[0]
    return [type(m) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                              layer.mlp.gate_up_proj, layer.mlp.down_proj, model.lm_head)]  # fmt: skip


def _llm(path: str, **kw) -> LLM:
    return LLM(path, dtype="bfloat16", quantization="none", num_pages=64,
               max_seq_len_override=128, **kw)  # fmt: skip


def test_a_bf16_model_packs_its_linears_where_the_cpu_has_amx_tiles(tiny_model_dir, monkeypatch):
    """qwen2: a tied lm_head (the embedding keeps its weight) and biased QKV."""
    path = str(tiny_model_dir("qwen2"))
    llm = _llm(path)
    want = PackedLinear if HERE else nn.Linear
    assert _linears(llm) == [want] * 5
    embed = llm.engine.model.model.embed_tokens.weight
    assert embed.dtype == torch.bfloat16 and not embed.is_mkldnn
    monkeypatch.setenv(onednn_packed.ENV, "0")
    assert _linears(_llm(path)) == [nn.Linear] * 5


@needs_amx
def test_packed_logits_are_the_unpacked_ones_within_bf16_rounding(tiny_model_dir, monkeypatch):
    """The same prompts' next-token logits, packed and not, agree to bf16's precision."""
    from minisgl.benchmark.cpu_speed import prompt_logits

    path = str(tiny_model_dir("llama"))
    ids = [5, 17, 99, 3, 250, 41, 7, 8] * 5
    packed = prompt_logits(_llm(path), ids).float()
    monkeypatch.setenv(onednn_packed.ENV, "0")
    plain = prompt_logits(_llm(path), ids).float()
    scale = plain.abs().max()
    assert (packed - plain).abs().max() <= 2.0**-6 * scale


def test_deterministic_mode_and_compiled_graphs_keep_their_own_linears(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    if onednn_packed.available(torch.bfloat16, CPU):
        try:
            det = _llm(path, deterministic=True)
        except ValueError:  # the mode refused on this CPU: nothing to check
            det = None
        if det is not None:
            assert PackedLinear not in _linears(det)
    compiled = _llm(path, enable_torch_compile=True)
    assert PackedLinear not in _linears(compiled)
