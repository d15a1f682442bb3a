"""W8A8 on CPU (card P2-004): int8 activations times int8 weights on the int8 matrix units, with
SmoothQuant factors folded into the weights from a calibration forward at load.

Every test reaches the new modules through `_w8a8()` / `_smooth()`, so before they exist each
test fails by assertion, not by an import error of the whole file.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.config import ModelConfig
from minisgl.models.loader import load_model
from minisgl.quantization.linear import Int8Linear
from minisgl.testing.cpu_speed import run_cpu_speed
from minisgl.testing.modules import require_module
from minisgl.testing.scenarios import assert_kv_clean, random_prompts
from minisgl.testing.tiny_models import write_tiny_model
from minisgl.utils.cpu import amx_tiles

pytestmark = pytest.mark.isa_paths  # again without AMX on an AMX Xeon (noxfile.py)
CARD = "P2-004"
RED = "failing-tests-w8a8-layers-calibration-and-smoothing"
GEMM = "int8-activations-times-int8-weights-match-the-integer-reference"
ROWS = "activations-quantize-per-row-symmetric-to-nearest"
CALIB = "calibration-records-each-linear-input-s-channel-maxima"
SMOOTH = "smoothing-leaves-the-float-model-s-logits-unchanged"
ENGINE = "a-w8a8-model-runs-its-prefill-linears-on-int8-activations"
# the done cards' items say 2% (gated where it held: +1.87% amd-epyc); the bound is 3% on every
# kind (intel-amx measured +2.15%): their text changes with a re-gate (`nox -s card -- P2-004`,
# `-- P2-005`: editing a done card without one fails the board's lint)
EMBEDDED = "the-embedded-model-in-w8a8-answers-paris-within-2-of-fp32-perplexity"
REFUSE = "a-cpu-without-int8-matrix-instructions-refuses-w8a8"
RED_FUSED = "failing-tests-fused-input-quantization"
FUSED_OP = "a-linear-s-input-norm-or-silu-x-up-quantizes-in-one-c-pass"
FUSED_MODEL = "a-w8a8-model-quantizes-its-norms-and-silu-x-up-in-those-passes"
GREEN = "w8a8-linears-through-onednn-s-int8-gemm"
REFACTOR = "one-activation-quantization-for-every-w8a8-path"
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _w8a8() -> ModuleType:
    return require_module("minisgl.quantization.w8a8")


def _smooth() -> ModuleType:
    return require_module("minisgl.quantization.smooth")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Any:
    return write_tiny_model("llama", tmp_path_factory.mktemp("w8a8") / "llama", seed=3)


def _float_model(path: Any, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    cfg = ModelConfig.from_dir(path)
    return load_model(path, cfg, dtype, torch.device("cpu"), max_positions=256)


@pytest.mark.int8_matrix_unit
@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, GEMM)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (37, 96, 160), (300, 3072, 576)])
def test_int8_gemm_matches_the_integer_reference(m, n, k, out_dtype):
    w8 = _w8a8()
    g = torch.Generator().manual_seed(m * 7 + n)
    xq = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    ws = torch.rand(n, generator=g) * 0.01 + 1e-4
    got = torch.ops.minisgl.w8a8_mm(xq, wq, ws, out_dtype)
    ref = (xq.long() @ wq.long().t()).double() * ws.double()  # exact integer products
    assert got.dtype == out_dtype and got.shape == (m, n)
    tol = 1e-6 if out_dtype == torch.float32 else 2.0**-8
    err = (got.double() - ref).abs() / ref.abs().clamp(min=1e-3)
    assert float(err.max()) <= tol, float(err.max())
    assert w8.W8A8Linear is not None


@pytest.mark.int8_matrix_unit
@pytest.mark.card(CARD, GEMM)
@pytest.mark.card(CARD, GREEN)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_int8_gemm_runs_on_an_optimized_onednn_kernel(out_dtype, capfd):
    """oneDNN's verbose log names the matmul implementation each call runs: never its reference
    loop. On a CPU with AVX512-VNNI and no AMX (AMD EPYC, 2 threads) int8 activations took
    oneDNN's `ref_int8` at 0.9 s for one 256 x 576 x 576 GEMM; u8 ones with a zero point of 128
    take `brg_matmul:avx512_core_vnni` at 0.24 ms."""
    g = torch.Generator().manual_seed(5)
    xq = torch.randint(-127, 128, (64, 256), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (128, 256), generator=g, dtype=torch.int8)
    ws = torch.rand(128, generator=g) * 0.01 + 1e-4
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        got = torch.ops.minisgl.w8a8_mm(xq, wq, ws, out_dtype)
    log = capfd.readouterr().out.splitlines()
    matmuls = [line.split(",")[6] for line in log if ",exec,cpu,matmul," in line]
    assert matmuls, log
    assert not [m for m in matmuls if m.startswith("ref")], matmuls
    ref = (xq.long() @ wq.long().t()).double() * ws.double()
    assert float((got.double() - ref).abs().max()) <= 2.0**-7 * float(ref.abs().max())


@pytest.mark.int8_matrix_unit
@pytest.mark.card(CARD, GEMM)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_w8a8_layer_is_the_integer_computation_of_its_rows(dtype):
    """`W8A8Linear` written out: per-row int8 codes, an exact integer matmul, both scales, the
    bias; within ~1% of the output range of the float product."""
    w8 = _w8a8()
    from minisgl.quantization.packed import quantize_int8

    g = torch.Generator().manual_seed(1)
    w, bias = torch.randn(96, 128, generator=g) * 0.3, torch.randn(96, generator=g) * 0.1
    q = quantize_int8(w)
    layer = w8.W8A8Linear(q, bias, dtype)
    x = (torch.randn(40, 128, generator=g) * torch.linspace(0.1, 3.0, 40)[:, None]).to(dtype)
    out = layer(x[None])[0]  # leading dimensions kept
    xf = x.float()
    sx = xf.abs().amax(dim=1, keepdim=True) / 127.0
    acc = torch.round(xf / sx).long() @ q.q.long().t()
    want = (acc.double() * sx.double() * q.scale.double()).float() + bias.to(dtype).float()
    assert out.dtype == dtype and out.shape == (40, 96)
    tol = 1e-5 if dtype == torch.float32 else 0.01
    torch.testing.assert_close(out.float(), want, atol=tol * float(want.abs().max()), rtol=0)
    ref = xf @ q.dequantize().t() + bias.to(dtype).float()
    torch.testing.assert_close(out.float(), ref, atol=0.02 * float(ref.abs().max()), rtol=0)


@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, ROWS)
def test_activations_quantize_per_row_symmetric_to_nearest():
    w8 = _w8a8()
    x = torch.tensor(
        [[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -0.7, 0.02]]
    ).bfloat16()
    xq, scale = w8.quantize_rows(x)
    assert xq.dtype == torch.int8 and scale.dtype == torch.float32
    assert scale.shape == (3, 1)
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    assert torch.allclose(scale[[0, 2]], amax[[0, 2]] / 127, rtol=1e-6)
    assert xq[1].eq(0).all() and torch.isfinite(scale).all()  # a zero row stays zero
    assert xq[0].tolist() == [64, -127, 32, 0]  # 63.5 rounds to even (64), the max to 127
    expect = torch.round(xf[2] / scale[2]).to(torch.int8)
    assert xq[2].tolist() == expect.tolist() and int(xq[2].abs().max()) == 127


@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, CALIB)
def test_calibration_records_each_linear_inputs_channel_maxima(tiny_llama):
    sm = _smooth()
    model = _float_model(tiny_llama)
    ids = list(range(5, 45))
    maxima = sm.channel_maxima(model, ids)
    layers = model.model.layers
    assert set(maxima) == {f"model.layers.{i}.{n}" for i in range(len(layers)) for n in LINEARS}
    for i, layer in enumerate(layers):
        for n in LINEARS:
            parent, leaf = n.split(".")
            lin = getattr(getattr(layer, parent), leaf)
            got = maxima[f"model.layers.{i}.{n}"]
            assert got.shape == (lin.in_features,) and got.dtype == torch.float32
            assert bool((got >= 0).all()) and float(got.max()) > 0
    # layer 0's QKV input, computed by hand: RMSNorm of the embeddings
    x = model.model.embed_tokens(torch.tensor(ids)).float()
    norm = layers[0].input_layernorm
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
    expect = h.abs().amax(dim=0)
    assert torch.allclose(maxima["model.layers.0.self_attn.qkv_proj"], expect, rtol=1e-5)


@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, SMOOTH)
def test_smoothing_leaves_the_float_logits_unchanged(tiny_llama):
    sm = _smooth()
    model = _float_model(tiny_llama)
    ids = list(range(3, 60))
    before = sm.float_logits(model, ids)
    norm0 = model.model.layers[0].input_layernorm.weight.detach().clone()
    maxima = sm.channel_maxima(model, ids)
    # an outlier channel, as real models have: smoothing must move it into the weights
    maxima["model.layers.0.self_attn.qkv_proj"][3] *= 50.0
    sm.smooth_model(model, maxima, alpha=0.7)
    after = sm.float_logits(model, ids)
    assert not torch.equal(norm0, model.model.layers[0].input_layernorm.weight)
    assert torch.allclose(before, after, atol=1e-4, rtol=1e-4), float((before - after).abs().max())
    with pytest.raises(ValueError, match="alpha"):
        sm.smooth_model(model, maxima, alpha=1.5)


def _count_gemms(monkeypatch) -> list[int]:
    w8 = _w8a8()
    rows: list[int] = []
    impl = w8.int8_gemm

    def counted(xq, qweight, scales, out_dtype):
        rows.append(xq.shape[0])
        return impl(xq, qweight, scales, out_dtype)

    monkeypatch.setattr(w8, "int8_gemm", counted)
    return rows


@pytest.mark.int8_matrix_unit
@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, ENGINE)
@pytest.mark.parametrize("compiled", [False, True])
def test_a_w8a8_model_runs_its_linears_on_int8_activations(tiny_llama, monkeypatch, compiled):
    w8 = _w8a8()
    llm = LLM(
        str(tiny_llama), quantization="w8a8", dtype="bfloat16", num_pages=2048,
        enable_torch_compile=compiled, max_running_requests=16,
    )  # fmt: skip
    layers = llm.engine.model.model.layers
    assert all(isinstance(getattr(getattr(ly, p), n), w8.W8A8Linear)
               for ly in layers for p, n in (s.split(".") for s in LINEARS))  # fmt: skip
    rows = _count_gemms(monkeypatch)
    prompts = random_prompts(12, 20, 70, vocab=300, seed=5)
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [len(o["token_ids"]) for o in out] == [8] * 12
    per_step = 4 * len(layers)
    assert max(rows) >= 240, "no prefill step ran its linears on int8 activations"
    # 7 decode steps of the 12 requests (the first token comes from the prefill): on int8
    # activations, except in compiled decode graphs of a bf16 model on AMX (the weight-only AMX
    # template there, faster at decode batches); the lm_head is weight-only int8 everywhere
    # (the logits from bf16 activations), so no int8 GEMM of 12 rows there
    assert isinstance(llm.engine.model.lm_head, Int8Linear)
    if compiled and amx_tiles():
        assert rows.count(12) == 0, "compiled decode graphs on AMX: the weight-only template"
        assert llm.engine.compiled is not None and llm.engine.compiled.steps >= 7
    elif llm.engine.cpu_decode is not None:  # the C decode step (P2-006): its own int8 GEMMs
        assert llm.engine.cpu_decode.kind == "w8a8" and llm.engine.cpu_decode.steps >= 7
        assert rows.count(12) == 0
    else:
        assert rows.count(12) >= per_step * 7, "decode steps did not run on int8 activations"
    assert_kv_clean(llm)
    # against the same model's weight-only int8 run: the int8 activations only nudge the logits
    ref = LLM(str(tiny_llama), quantization="int8", dtype="bfloat16", num_pages=512)
    ref_out = ref.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
    same = sum(o["token_ids"][0] == r["token_ids"][0] for o, r in zip(out, ref_out, strict=True))
    assert same >= 9, same


@pytest.mark.int8_matrix_unit
@pytest.mark.slow
@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, EMBEDDED)
@pytest.mark.card("P2-005", "w8a8-stays-within-2-of-fp32-perplexity-over-ten-texts")
def test_the_embedded_model_in_w8a8_agrees_with_fp32_within_3pc_perplexity():
    """Over the ten texts (`PPL_TEXTS`, 896 positions, each text through one prefill): the
    perplexity as the geometric mean within 3% of fp32's, and the next token w8a8 would pick
    the one fp32 picks at >= 85% of the positions (each teacher-forced).
    What holds on every kind with margin, not a greedy answer at the edge: the kinds round the
    bf16 parts differently (an AMX Xeon's prefill attention rounds its probabilities to bf16,
    oneDNN's kernels and the CPU's reciprocal square root differ), and a 135M model's greedy
    answer to one question flips with them ("The capital of France is Paris." on an AMD EPYC,
    "L'Etoile 18, the capital of" on an AMX Xeon). Measured: w8a8 +1.87% (AMD EPYC), +2.15%
    (AMX Xeon); agreement 0.920 on the AMD EPYC (bf16 without int8: 0.968, +0.09%)."""
    from minisgl.benchmark.cpu_speed import (
        PPL_TEXTS,
        geometric_mean,
        perplexity_of,
        prompt_logits,
        top1_agreement,
    )

    _w8a8()

    def logits(**kw: Any) -> tuple[list[torch.Tensor], list[list[int]]]:
        llm = LLM(max_seq_len_override=512, **kw)
        ids = [llm.tokenizer.encode(t) for t in PPL_TEXTS]
        return [prompt_logits(llm, i) for i in ids], [i[1:] for i in ids]

    w8, targets = logits(quantization="w8a8", dtype="bfloat16")
    fp32, _ = logits(quantization="none", dtype="float32")
    ppl = geometric_mean(perplexity_of(lg, t) for lg, t in zip(w8, targets, strict=True))
    ref = geometric_mean(perplexity_of(lg, t) for lg, t in zip(fp32, targets, strict=True))
    agree = top1_agreement(w8, fp32)
    print(f"perplexity over ten texts: w8a8 {ppl:.3f}, fp32 {ref:.3f} ({ppl / ref - 1:+.2%}); "
          f"next-token agreement {agree:.3f} over {sum(map(len, targets))} positions")  # fmt: skip
    assert math.isfinite(ppl) and ppl <= ref * 1.03, (ppl, ref)
    assert agree >= 0.85, agree


@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, REFUSE)
def test_a_cpu_without_int8_matrix_instructions_refuses_w8a8(tiny_llama, monkeypatch):
    w8 = _w8a8()
    monkeypatch.setattr(w8, "w8a8_supported", lambda: False)
    with pytest.raises(ValueError, match="w8a8.*int8 matrix"):
        LLM(str(tiny_llama), quantization="w8a8", dtype="bfloat16", num_pages=64)
    with pytest.raises(ValueError, match="quantization must be"):
        from minisgl.config import EngineConfig

        EngineConfig(model_path="x", quantization="w4a4")


@pytest.mark.card(CARD, REFUSE)
def test_the_int8_gemm_refuses_a_cpu_without_int8_matrix_instructions(monkeypatch):
    """Without an int8 matrix unit oneDNN's int8 GEMM runs its AVX2 kernel, whose u8 x s8 pair
    sums saturate at int16 (`gemm:jit` on an AMD EPYC without VNNI: 20-25% of the output range
    off for codes in [-127, 127], s8 or u8 activations alike): the GEMM and a W8A8 layer raise
    rather than return those numbers."""
    w8 = _w8a8()
    from minisgl.quantization.packed import quantize_int8

    monkeypatch.setattr(w8, "w8a8_supported", lambda: False)
    wq = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    xq = torch.randint(-127, 128, (3, 64), dtype=torch.int8)
    with pytest.raises(RuntimeError, match="int8 matrix instructions.*AMX-INT8.*AVX512-VNNI"):
        w8.int8_gemm(xq, wq, torch.ones(16), torch.float32)
    layer = w8.W8A8Linear(quantize_int8(torch.randn(16, 64)), None, torch.float32)
    with pytest.raises(RuntimeError, match="int8 matrix instructions"):
        layer(torch.randn(1, 3, 64))


@pytest.mark.card(CARD, REFUSE)
def test_tests_that_need_an_int8_matrix_unit_say_why_they_skip(monkeypatch):
    """The `int8_matrix_unit` marker (root conftest): where W8A8 refuses, its tests skip as
    missing evidence naming the ISA level and the CPU's features; where it runs, they run."""
    capability = require_module("minisgl.testing.capability")
    w8 = _w8a8()
    monkeypatch.setattr(w8, "w8a8_supported", lambda: True)
    assert capability.int8_matrix_unit_missing() is None
    monkeypatch.setattr(w8, "w8a8_supported", lambda: False)
    why = capability.int8_matrix_unit_missing()
    assert why is not None and why.startswith("int8_matrix_unit")
    assert "(missing evidence)" in why and "MINISGL_CPU_ISA=" in why and "features" in why


@pytest.mark.gate_only
@pytest.mark.bench
@pytest.mark.card(
    CARD, "many-short-at-least-3x-hf-bf16-with-w8a8-and-compiled-steps-perplexity-within-2-of-fp32"
)
def test_w8a8_many_short_vs_hf_bf16(metric, tmp_path):
    """`cpu_speed` on many-short (128 requests): minisgl w8a8 with compiled steps beside HF bf16
    `generate`, 2 threads, median of 2 repeats, same run (the perplexity bound is the embedded
    model's test above)."""
    arms = run_cpu_speed(tmp_path, "w8a8-compiled", profiles="many-short", hf="bf16")["many-short"]
    mini, hf16 = arms["minisgl-w8a8-compiled"]["output_tok_s"], arms["hf-bf16"]["output_tok_s"]
    print(f"many-short: minisgl w8a8 compiled {mini:.1f} tok/s, HF bf16 {hf16:.1f} "
          f"({mini / hf16:.2f}x)")  # fmt: skip
    metric("many_short_tok_s_minisgl", mini, unit="tok/s")
    metric("many_short_tok_s_hf_bf16", hf16, unit="tok/s")


@pytest.mark.int8_matrix_unit
@pytest.mark.card(CARD, GEMM)
def test_a_freed_layer_takes_its_packed_weights_with_it():
    """The prepacked copies are found by the weight's storage; a freed model must not leave its
    weights (or their packed copies) in the registry."""
    import gc

    w8 = _w8a8()
    from minisgl.quantization.packed import quantize_int8

    gc.collect()  # earlier tests' models: freed here, not inside the measurement
    before = len(w8._PACKED)
    layer = w8.W8A8Linear(quantize_int8(torch.randn(64, 96)), None, torch.bfloat16)
    assert len(w8._PACKED) == before + 1
    out = layer(torch.randn(5, 96).bfloat16())
    assert out.shape == (5, 64)
    del layer
    gc.collect()
    assert len(w8._PACKED) == before


def _quant_op() -> Any:
    op = getattr(torch.ops.minisgl, "w8a8_quant", None) if _w8a8() else None
    assert op is not None, "no minisgl::w8a8_quant operator"
    return op


def _reference_h(x: torch.Tensor, kind: str, w: Any, in_scale: Any, eps: float) -> torch.Tensor:
    """The input each kind quantizes, as the model's eager ops in x's dtype form it (each
    intermediate rounded to bf16)."""
    from minisgl.models.layers import RMSNorm

    if kind == "rmsnorm":
        norm = RMSNorm(x.shape[1], eps).to(x.dtype)
        norm.weight.data.copy_(w)
        return norm(x)
    if kind == "silu_mul":
        if in_scale is not None:
            x = (x.float() * in_scale.reshape(-1, 1)).to(x.dtype)
        g, u = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u
    return x


@pytest.mark.card(CARD, RED_FUSED)
@pytest.mark.card(CARD, FUSED_OP)
@pytest.mark.parametrize(
    "kind,scaled", [("rows", False), ("rmsnorm", False), ("silu_mul", False), ("silu_mul", True)]
)
@pytest.mark.parametrize("rows,n", [(1, 64), (37, 72), (300, 576)])
def test_a_fused_input_quantization_codes_each_row_as_quantize_rows(kind, scaled, rows, n):
    """`minisgl::w8a8_quant(x, weight, in_scale, eps, kind)` of bf16 rows: codes and scales of
    `quantize_rows` over the kind's input (the row itself, its RMSNorm, SiLU(gate) x up of its
    two halves, after a per-row scale) formed as the eager bf16 ops form it; a code may differ
    by one where the value lies within a rounding of a half step."""
    op, w8 = _quant_op(), _w8a8()
    g = torch.Generator().manual_seed(rows * 3 + n)
    width = 2 * n if kind == "silu_mul" else n
    x = (torch.randn(rows, width + 8, generator=g) * 3)[:, 4 : 4 + width].bfloat16()  # strided
    x[0, 1] = 40.0  # an outlier sets row 0's scale
    w = (torch.rand(n, generator=g) + 0.5).bfloat16() if kind == "rmsnorm" else None
    sx = torch.rand(rows, 1, generator=g) * 0.02 + 1e-3 if scaled else None
    codes, scales = op(x, w, sx, 1e-5, kind)
    want_codes, want_scales = w8.quantize_rows(_reference_h(x, kind, w, sx, 1e-5))
    assert codes.dtype == torch.int8 and codes.shape == (rows, n)
    assert scales.dtype == torch.float32 and scales.shape == (rows, 1)
    # a row's scale may differ by the bf16 rounding of its largest value (SiLU's exp is the
    # kernel's own: a rounding of silu(g) can flip), its codes then by up to two
    same = ((scales - want_scales).abs() <= 1e-5 * want_scales).flatten()
    torch.testing.assert_close(scales, want_scales, rtol=2.0**-6, atol=0)
    assert float(same.float().mean()) >= (0.95 if kind == "silu_mul" else 1.0)
    diff = (codes.int() - want_codes.int()).abs()
    assert int(diff.max()) <= 2 and int(diff[same].max()) <= 1
    assert float((diff[same] > 0).float().mean()) < 0.01
    assert int(codes.abs().max()) == 127


@pytest.mark.card(CARD, FUSED_OP)
def test_silu_mul_quantization_of_extreme_gates():
    """Gates far outside exp's range (|g| up to 1000: SiLU is g or 0 there) code as the eager
    ops do: the kernel clamps exp's argument so 1 / (1 + e^-g) stays a normal float."""
    op, w8 = _quant_op(), _w8a8()
    g = torch.Generator().manual_seed(4)
    gate = torch.tensor([-1000.0, -200.0, -90.0, -81.0, -20.0, 0.0, 20.0, 90.0, 200.0, 1000.0])
    gate = gate.repeat(4, 4)[:, :32]
    x = torch.cat([gate, torch.randn(4, 32, generator=g) + 2.0], dim=1).bfloat16()
    codes, scales = op(x, None, None, 0.0, "silu_mul")
    want_codes, want_scales = w8.quantize_rows(_reference_h(x, "silu_mul", None, None, 0.0))
    torch.testing.assert_close(scales, want_scales, rtol=2.0**-6, atol=0)
    assert int((codes.int() - want_codes.int()).abs().max()) <= 1
    assert bool(codes[:, gate[0] < -50].eq(0).all())  # SiLU of a large negative gate is 0


@pytest.mark.card(CARD, RED_FUSED)
@pytest.mark.card(CARD, FUSED_OP)
def test_a_fused_input_quantization_refuses_bad_operands():
    op = _quant_op()
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises((ValueError, RuntimeError), match="kind"):
        op(x, None, None, 0.0, "gelu")
    with pytest.raises((ValueError, RuntimeError), match="weight"):
        op(x, torch.ones(32).bfloat16(), None, 1e-5, "rmsnorm")
    with pytest.raises((ValueError, RuntimeError), match="even"):
        op(torch.randn(4, 63).bfloat16(), None, None, 0.0, "silu_mul")
    codes, scales = op(torch.zeros(3, 64).bfloat16(), None, None, 0.0, "rows")
    assert codes.eq(0).all() and torch.isfinite(scales).all()


@pytest.mark.int8_matrix_unit
@pytest.mark.card(CARD, RED_FUSED)
@pytest.mark.card(CARD, FUSED_MODEL)
@pytest.mark.card(CARD, REFACTOR)
@pytest.mark.parametrize("compiled", [False, True])
def test_a_w8a8_model_quantizes_norms_and_silu_mul_in_the_fused_pass(
    tiny_llama, monkeypatch, compiled
):
    """The input norms move into the QKV and gate/up linears' quantization, SiLU x up (with the
    gate/up GEMM's per-row scale) into down's: three fused passes a layer in a prefill step
    and no other per-row quantization there; the model's next tokens are those of the same
    weights through the unfused ops."""
    w8 = _w8a8()
    _quant_op()
    opts = dict(quantization="w8a8", dtype="bfloat16", num_pages=2048, max_running_requests=16)
    llm = LLM(str(tiny_llama), enable_torch_compile=compiled, **opts)
    layers = llm.engine.model.model.layers
    for ly in layers:
        assert isinstance(ly.input_layernorm, torch.nn.Identity)
        assert isinstance(ly.post_attention_layernorm, torch.nn.Identity)
        assert isinstance(ly.mlp, w8.W8A8MLP)
    kinds: list[tuple[str, int]] = []
    impl = w8.quantize_input

    def counted(x, weight, in_scale, eps, kind, u8=False):
        kinds.append((kind, x.shape[0]))
        return impl(x, weight, in_scale, eps, kind, u8)

    monkeypatch.setattr(w8, "quantize_input", counted)
    calls = _count_gemms(monkeypatch)
    prompts = random_prompts(6, 40, 60, vocab=300, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompts, params)
    assert [len(o["token_ids"]) for o in out] == [6] * 6
    prefill = [k for k, rows in kinds if rows >= 240]
    n = len(layers)
    assert sorted(set(prefill)) == ["rmsnorm", "rows", "silu_mul"], kinds[:8]
    assert prefill.count("rmsnorm") == 2 * n and prefill.count("silu_mul") == n
    assert prefill.count("rows") == n  # o_proj's input; the lm_head's rows are the sampled ones
    assert sum(r >= 240 for r in calls) == 4 * n
    assert_kv_clean(llm)
    # the same weights through the unfused modules (`MINISGL_W8A8_FUSED=0`): the first token of
    # each of 12 prompts (later ones of this random model's flat logits flip on a code of one:
    # the unfused ops round their intermediates to bf16, the fused pass keeps fp32)
    monkeypatch.setenv("MINISGL_W8A8_FUSED", "0")
    ref = LLM(str(tiny_llama), **opts)
    assert not isinstance(ref.engine.model.model.layers[0].mlp, w8.W8A8MLP)
    prompts = random_prompts(12, 20, 70, vocab=300, seed=11)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    firsts = [o["token_ids"][0] for o in llm.generate(prompts, one)]
    ref_firsts = [o["token_ids"][0] for o in ref.generate(prompts, one)]
    assert sum(a == b for a, b in zip(firsts, ref_firsts, strict=True)) >= 11, (firsts, ref_firsts)
