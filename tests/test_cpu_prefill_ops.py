"""The elementwise ops around a bf16 prefill's GEMMs on CPU, in C (card P2-006, issue 35).

On the AMD EPYC kind a w8a8 prefill of many-short (2,586 tokens) spent ~0.27 s of ~0.94 outside
oneDNN's int8 GEMMs: each linear's row scale as three torch ops over fp32 copies
(`(y.float() * sx).to(bf16)`), RoPE as flip / mul / add over q and k, the activations' sign
bit flipped by a separate pass before every GEMM (oneDNN's VNNI kernels take u8). The C ops
(`kernels/cpu/prefill_ops.c`, `quant.c`) do each in one pass, the same arithmetic: the results
are the torch ops' to the bit, so nothing downstream moves.

Every test reaches the new kernels through `_kernel()`, so before they exist each fails by
assertion.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl import LLM
from minisgl.testing.tiny_models import write_tiny_model

CARD = "P2-006"
RED = "failing-tests-the-prefill-s-fused-ops"
ITEM = "the-prefill-s-row-scale-rope-and-u8-codes-are-the-torch-ops-to-the-bit"
GREEN = "the-w8a8-prefill-s-elementwise-ops-run-in-c"


def _kernel(name: str) -> Any:
    from minisgl.kernels import cpu as cpu_native

    assert cpu_native.available(torch.bfloat16), "the C kernels did not build"
    fn = getattr(cpu_native, name, None)
    assert fn is not None, f"kernels.cpu.{name} is missing"
    return fn


def _spread(rows: int, n: int, g: torch.Generator) -> torch.Tensor:
    """bf16 [rows, n]: normal values times a power of two per row (2^-40 .. 2^40)."""
    exps = torch.randint(-40, 41, (rows, 1), generator=g).float()
    return (torch.randn(rows, n, generator=g) * torch.exp2(exps)).bfloat16()


@pytest.mark.isa_paths  # the AVX-512 loop and the plain one (noxfile.py's ISA levels)
@pytest.mark.card(CARD, ITEM)
@pytest.mark.card(CARD, RED)
@pytest.mark.parametrize(("rows", "n"), [(1, 16), (3, 67), (64, 576), (257, 960)])
def test_scale_rows_is_the_torch_expression_to_the_bit(rows: int, n: int) -> None:
    """`scale_rows_(y, s)`: y = bf16(float(y) * s) per row, in place, as
    `(y.float() * s).to(bf16)` gives it (one product in fp32, rounded to nearest even), rows
    any stride apart; overflow to inf where torch's rounding overflows."""
    scale_rows_ = _kernel("scale_rows_")
    g = torch.Generator().manual_seed(rows * 31 + n)
    wide = _spread(rows, n + 5, g)
    y = wide[:, 2 : 2 + n]  # rows n + 5 apart
    s = torch.rand(rows, 1, generator=g) * torch.exp2(torch.randint(-20, 80, (rows, 1),
                                                                     generator=g).float())  # fmt: skip
    expected = (y.float() * s).to(torch.bfloat16)
    before = wide.clone()
    out = scale_rows_(y, s)
    assert out.data_ptr() == y.data_ptr()
    assert torch.equal(y, expected)
    assert torch.equal(wide[:, :2], before[:, :2]) and torch.equal(
        wide[:, 2 + n :], before[:, 2 + n :]
    )
    flat = y.clone()
    scale_rows_(flat, s.flatten())  # scales as [rows] too
    assert torch.equal(flat, (expected.float() * s).to(torch.bfloat16))


@pytest.mark.card(CARD, ITEM)
def test_scale_rows_refuses_bad_input() -> None:
    scale_rows_ = _kernel("scale_rows_")
    y = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scale"):
        scale_rows_(y, torch.ones(3, 1))
    with pytest.raises(ValueError, match="bf16"):
        scale_rows_(y.float(), torch.ones(4, 1))
    with pytest.raises(ValueError, match="contiguous"):
        scale_rows_(y.t(), torch.ones(8, 1))


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    return torch.cat((x[..., d // 2 :], x[..., : d // 2]), dim=-1)


@pytest.mark.isa_paths
@pytest.mark.card(CARD, ITEM)
@pytest.mark.card(CARD, RED)
@pytest.mark.parametrize("tokens", [1, 5, 70])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "d"), [(9, 3, 64), (4, 4, 32), (2, 1, 128), (1, 1, 8)]
)
def test_rope_is_the_torch_ops_to_the_bit(tokens: int, heads: int, kv_heads: int, d: int) -> None:
    """`rope(q, k, cos, sin)`: new q and k, each head q * cos + swap_halves(q) * sin with the
    model's signed sin table, the products and the sum each rounded to bf16 as the torch ops
    round them; q and k as the QKV GEMM's views (rows apart by the whole QKV width), left as
    they were."""
    rope = _kernel("rope")
    g = torch.Generator().manual_seed(tokens * 13 + heads * 7 + d)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).bfloat16() * 3
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d)
    cos = torch.randn(tokens, d, generator=g).bfloat16()
    sin = torch.randn(tokens, d, generator=g).bfloat16()
    c3, s3 = cos[:, None, :], sin[:, None, :]
    ref_q = q * c3 + _swap_halves(q) * s3
    ref_k = k * c3 + _swap_halves(k) * s3
    before = qkv.clone()
    got_q, got_k = rope(q, k, cos, sin)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
    assert torch.equal(qkv, before)


@pytest.mark.card(CARD, ITEM)
@pytest.mark.card(CARD, RED)
@pytest.mark.parametrize("kind", ["rows", "rmsnorm", "silu_mul"])
def test_u8_codes_are_the_int8_codes_plus_128(kind: str) -> None:
    """`quant_rows(..., unsigned=True)`: the codes oneDNN's VNNI GEMM takes (code + 128, as
    u8), the same scales: the separate sign-flip pass before each GEMM goes."""
    quant_rows = _kernel("quant_rows")
    assert "unsigned" in inspect.signature(quant_rows).parameters, "no u8 codes"
    g = torch.Generator().manual_seed(3)
    width = 2 * 96 if kind == "silu_mul" else 96
    x = torch.randn(37, width, generator=g).bfloat16()
    w = torch.rand(96, generator=g).bfloat16() if kind == "rmsnorm" else None
    s = torch.rand(37, generator=g) if kind == "silu_mul" else None
    codes, scales = quant_rows(x, w, s, 1e-6, kind)
    u8, u8_scales = quant_rows(x, w, s, 1e-6, kind, unsigned=True)
    assert u8.dtype == torch.uint8 and u8.shape == codes.shape
    assert torch.equal(u8, codes.view(torch.uint8) ^ 0x80)
    assert torch.equal(u8_scales, scales)


@pytest.mark.int8_matrix_unit
@pytest.mark.card(CARD, ITEM)
@pytest.mark.card(CARD, RED)
def test_the_int8_gemm_takes_u8_codes() -> None:
    """`w8a8.int8_gemm` of u8 codes (code + 128) equals it of the int8 codes, on either kind
    (oneDNN's VNNI kernels take u8 as they are; AMX takes the codes back as s8)."""
    from minisgl.quantization import w8a8

    g = torch.Generator().manual_seed(5)
    xq = torch.randint(-127, 128, (19, 160), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (48, 160), generator=g, dtype=torch.int8)
    scales = torch.rand(48, generator=g) * 1e-3
    signed = w8a8.int8_gemm(xq, wq, scales, torch.bfloat16)
    unsigned = w8a8.int8_gemm(xq.view(torch.uint8) ^ 0x80, wq, scales, torch.bfloat16)
    assert torch.equal(unsigned, signed)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory) -> Path:
    return write_tiny_model(request.param, tmp_path_factory.mktemp("prefill-ops") / request.param,
                            seed=9)  # fmt: skip


def _prefill_logits(llm: Any, prompts: list[list[int]]) -> tuple[torch.Tensor, list[str]]:
    """The logits of one prefill step of `prompts` (of one length) and the names of the torch
    ops it ran."""
    from minisgl.testing.plans import batch_decode_logits

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = batch_decode_logits(llm, prompts, prefix=len(prompts[0]) - 1)[0]
    return logits, [e.name for e in prof.events()]


@pytest.mark.int8_matrix_unit
@pytest.mark.card(CARD, GREEN)
@pytest.mark.card(CARD, RED)
def test_the_w8a8_prefill_runs_the_c_ops_with_the_same_logits(tiny: Path, monkeypatch) -> None:
    """A w8a8 bf16 prefill (the modules: `MINISGL_CPU_DECODE` plays no part) runs no sign-flip
    pass, no flip of q / k and no fp32 copy for a row scale; its logits equal those of the
    torch expressions' (`kernels.cpu.elementwise` off) to the bit."""
    from minisgl.kernels import cpu as cpu_native

    assert hasattr(cpu_native, "elementwise"), "kernels.cpu.elementwise is missing"
    llm = LLM(str(tiny), dtype="bfloat16", quantization="w8a8", num_pages=512)
    prompts = [[(7 * i + 5 * j) % 300 + 3 for j in range(13)] for i in range(6)]
    fused, ops = _prefill_logits(llm, prompts)
    layers = llm.engine.model.config.num_layers
    assert "aten::bitwise_xor" not in ops and "aten::flip" not in ops
    assert ops.count("aten::mul") <= 3, sorted(set(ops))  # final norm, tied int8 embedding
    monkeypatch.setattr(cpu_native, "elementwise", lambda x: False)
    ref, ref_ops = _prefill_logits(llm, prompts)
    assert "aten::flip" in ref_ops  # the reference did run the torch expressions
    # a layer's torch passes gone: RoPE's four products and three row scales' products, their
    # fp32 copies there and back (the step's other copies, e.g. of the positions, stay)
    assert ref_ops.count("aten::mul") - ops.count("aten::mul") == 7 * layers
    assert ref_ops.count("aten::_to_copy") - ops.count("aten::_to_copy") >= 6 * layers
    assert torch.equal(fused, ref)
