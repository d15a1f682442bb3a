"""The C decode step of w8a8 bf16 models (card P2-006, issue 35).

A decode step of a w8a8 model runs as one C call over the decoder layers
(`engine/cpu_decode.py`, `kernels/cpu/decode_step_w8a8.c`): the modules' own input quantization
(`quant.c`), an int8 GEMM over weights repacked into panels of 16 output channels, the scales
applied and rounded where the modules round them. The reference is the torch modules
(`MINISGL_CPU_DECODE=modules`) on the same weights: the logits are the same to the bit.

Every test reaches the new module through `_step()`, so before it exists each fails by
assertion, not by an import error of the whole file.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.testing.modules import require_module
from minisgl.testing.plans import batch_decode_logits
from minisgl.testing.scenarios import assert_kv_clean, random_prompts
from minisgl.testing.tiny_models import write_tiny_model

CARD = "P2-006"
RED = "failing-tests-the-panel-gemm-the-w8a8-c-step-where-it-runs"
GREEN = "decode-steps-of-w8a8-bf16-models-run-as-one-c-call"
REFACTOR = "the-row-ops-both-c-steps-use-written-once"
ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def _step() -> ModuleType:
    return require_module("minisgl.kernels.cpu.w8a8_step")


def _int8_reference(xq: torch.Tensor, wq: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bf16(float(xq @ wq^T) * scales): the int32 sums exact, one fp32 product, one rounding."""
    acc = (xq.double() @ wq.double().t()).float()
    return (acc * scales).bfloat16()


@pytest.mark.isa_paths  # the VNNI kernel and the plain loops (noxfile.py's ISA levels)
@pytest.mark.card(CARD, "the-int8-panel-gemm-is-the-integer-product-exactly")
@pytest.mark.card(CARD, RED)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 64, 131])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (67, 160), (576, 1536), (3072, 576), (5, 4)])
def test_the_panel_gemm_is_the_integer_product(rows: int, n: int, k: int) -> None:
    """Every output: the exact int32 sum of the codes' products (u8 activations, the weights'
    sums as the zero-point term), times the channel's scale in fp32, rounded once to bf16."""
    step = _step()
    g = torch.Generator().manual_seed(rows * 7 + n + k)
    wq = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    xq = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 1e-3 + 1e-5
    w = step.Int8Panels.of(wq, scales, None)
    got = step.int8_gemm(xq, w)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert torch.equal(got, _int8_reference(xq, wq, scales))


@pytest.mark.int8_matrix_unit
@pytest.mark.card(CARD, "the-int8-panel-gemm-is-the-integer-product-exactly")
def test_the_panel_gemm_is_onednns_to_the_bit() -> None:
    """Where oneDNN's int8 GEMM runs (the modules' `w8a8.int8_gemm`), the same bf16 outputs."""
    from minisgl.quantization import w8a8

    step = _step()
    g = torch.Generator().manual_seed(5)
    wq = torch.randint(-127, 128, (576, 1536), generator=g, dtype=torch.int8)
    scales = torch.rand(576, generator=g) * 1e-3 + 1e-5
    w = step.Int8Panels.of(wq, scales, None)
    for rows in (1, 7, 64):
        xq = torch.randint(-127, 128, (rows, 1536), generator=g, dtype=torch.int8)
        assert torch.equal(step.int8_gemm(xq, w), w8a8.int8_gemm(xq, wq, scales, torch.bfloat16))


def _exact_int8_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The modules' int8 GEMM (`w8a8.int8_gemm`, which their operator looks up at each call) as
    the exact integer product, u8 codes (code + 128) read back as int8: what the C step's panels
    compute on every ISA, so a comparison of the two paths tests their orchestration only."""
    from minisgl.quantization import w8a8

    def exact(xq: torch.Tensor, wq: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype):
        codes = (xq ^ 0x80).view(torch.int8) if xq.dtype == torch.uint8 else xq
        return ((codes.double() @ wq.double().t()).float() * scales).to(out_dtype)

    monkeypatch.setattr(w8a8, "int8_gemm", exact)


@pytest.mark.int8_matrix_unit
@pytest.mark.card(CARD, "the-int8-panel-gemm-is-the-integer-product-exactly")
@pytest.mark.parametrize("rows", [1, 7, 16, 64, 130])
@pytest.mark.parametrize(("n", "k"), [(192, 64), (256, 64), (64, 128), (576, 1536), (1536, 576)])
@pytest.mark.parametrize("u8", [False, True])
def test_onednns_int8_gemm_is_within_a_rounding_of_the_exact_product(
    rows: int, n: int, k: int, u8: bool
) -> None:
    """oneDNN's int8 GEMM (the modules' `w8a8.int8_gemm`, AMX-INT8 or VNNI kernels by CPU) at
    the tiny models' and the embedded model's shapes, s8 or u8 codes: every output within one
    bf16 rounding (2^-8 relative) of the exact product. Its kernels choose their blocking by
    shape and ISA, and where one sums partial products in fp32 a last bit may differ from the
    exact int32 sum: the bound holds whatever the kernel, where bit-equality held on the kinds
    measured at some shapes only."""
    from minisgl.quantization import w8a8

    g = torch.Generator().manual_seed(rows * 31 + n + k)
    wq = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    xq = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 1e-3 + 1e-5
    exact = ((xq.double() @ wq.double().t()) * scales.double()).float()
    codes = xq.view(torch.uint8) ^ 0x80 if u8 else xq
    got = w8a8.int8_gemm(codes, wq, scales, torch.bfloat16).float()
    assert bool(((got - exact).abs() <= exact.abs() * 2.0**-8 + 1e-30).all())


@pytest.mark.isa_paths
@pytest.mark.card(CARD, "the-int8-panel-gemm-refuses-bad-input")
def test_the_panel_gemm_refuses_bad_input() -> None:
    step = _step()
    wq = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    w = step.Int8Panels.of(wq, torch.ones(32), None)
    for bad, match in (
        (torch.zeros(2, 64), "xq"),  # fp32
        (torch.zeros(2, 32, dtype=torch.int8), "xq"),  # another K
        (torch.zeros(0, 64, dtype=torch.int8), "rows"),
        (torch.zeros(64, 2, dtype=torch.int8).t(), "xq"),  # columns not contiguous
    ):
        with pytest.raises(ValueError, match=match):
            step.int8_gemm(bad, w)
    with pytest.raises(ValueError, match="Int8Panels"):
        step.Int8Panels.of(wq.float(), torch.ones(32), None)  # not int8
    with pytest.raises(ValueError, match="Int8Panels"):
        step.Int8Panels.of(wq[:, :62], torch.ones(32), None)  # K not a multiple of 4
    with pytest.raises(ValueError, match="Int8Panels"):
        step.Int8Panels.of(wq, torch.ones(31), None)  # a scale short


@pytest.mark.isa_paths
@pytest.mark.card(CARD, "the-int8-panel-gemm-is-the-integer-product-exactly")
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (67, 160), (1000, 576)])
def test_the_c_head_is_the_weight_only_product(rows: int, n: int, k: int) -> None:
    """The lm_head of a w8a8 model (weight-only int8, bf16 activations): the products exact in
    fp32, summed in the kernel's order, times the scale, rounded once: within a bf16 rounding
    (and the fp32 sums' order) of the exact product, and of the modules' kernel."""
    step = _step()
    g = torch.Generator().manual_seed(rows + n + k)
    wq = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) * 1e-2 + 1e-4).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    got = step.int8_head(x, step.HeadPanels.of(wq, scales)).float()
    exact = ((x.double() @ wq.double().t()) * scales.double()).float()
    bound = exact.abs() / 128 + 1e-5 * (x.float().abs() @ (wq.float().abs().t() * scales.float()))
    assert got.shape == (rows, n) and bool(((got - exact).abs() <= bound).all())
    module = torch.ops.aten._weight_int8pack_mm(x, wq, scales).float()
    assert bool(((got - module).abs() <= 2 * bound).all())


class _CHead(torch.nn.Module):
    """An lm_head through the C head kernel: the reference the C step's logits equal."""

    def __init__(self, head: Any) -> None:
        super().__init__()
        self.w = _step().HeadPanels.of(head.qweight, head.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _step().int8_head(x.reshape(-1, x.shape[-1]).contiguous(), self.w)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory) -> Path:
    return write_tiny_model(request.param, tmp_path_factory.mktemp("w8a8-step") / request.param,
                            seed=7)  # fmt: skip


def _llm(path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, **kw: Any) -> Any:
    monkeypatch.setenv("MINISGL_CPU_DECODE", mode)
    return LLM(str(path), dtype="bfloat16", quantization="w8a8", **{"num_pages": 512, **kw})


@pytest.mark.int8_matrix_unit
@pytest.mark.card(CARD, "the-w8a8-c-decode-step-gives-the-modules-logits-on-every-architecture")
@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, GREEN)
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_the_w8a8_c_step_gives_the_modules_logits(tiny: Path, batch: int, monkeypatch) -> None:
    """Teacher-forced decode steps of `batch` requests, every one through the C step: each
    step's logits equal the modules' (the same int8 codes, exact int32 sums, the same roundings,
    the same lm_head kernel). Both multiply by the exact integer product (`_exact_int8_gemm`):
    the C step's panel GEMM is that on every ISA (its test above), oneDNN's kernels are within a
    bf16 rounding of it (`test_onednns_int8_gemm_is_within_a_rounding_of_the_exact_product`),
    their kernel chosen by the CPU: with them in the modules, an AMX Xeon's logits of llama /
    mistral at batch 16 differed by up to 0.195 (every other part of the two paths is the same
    code on every kind, or the C step's own, tested against the exact product at every ISA).
    Except after a q / k RMSNorm (Qwen3): torch sums a head's squares in its reduction's order,
    the C loop in its own, and a rare bf16 rounding of q or k flips (measured: one row of 64 from
    its second step, logits off by at most 0.17 of 6.8); there the rows stay within that
    rounding (cosine > 0.999) and choose the modules' token wherever the margin is clear."""
    _exact_int8_gemm(monkeypatch)
    prompts = random_prompts(batch, 14, 14, vocab=300, seed=batch)
    kw = {"num_pages": batch * 14 + 64, "max_running_requests": batch}
    c = _llm(tiny, monkeypatch, "c", **kw)
    assert c.engine.cpu_decode is not None and c.engine.cpu_decode.kind == "w8a8"
    got = batch_decode_logits(c, prompts, prefix=5)
    assert c.engine.cpu_decode.steps == 8
    ref_llm = _llm(tiny, monkeypatch, "modules", **kw)
    assert ref_llm.engine.cpu_decode is None
    # the modules' decode steps with the C step's lm_head (its own test above: within a bf16
    # rounding of the modules' kernel, which sums the products in another order)
    ref_llm.engine.model.lm_head = _CHead(ref_llm.engine.model.lm_head)
    ref = batch_decode_logits(ref_llm, prompts, prefix=5)[1:]
    got = got[1:]  # the prefill step's logits: the modules' head there
    assert got.shape == ref.shape == (8, batch, ref.shape[2])
    diff = (got - ref).abs().amax(dim=2)
    if not c.engine.model.config.qk_norm:
        assert torch.equal(got, ref), f"largest difference {float(diff.max())}"
        return
    got, ref = got.flatten(0, 1), ref.flatten(0, 1)
    assert float((diff == 0).float().mean()) >= 0.75, diff
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=1)
    assert float(cos.min()) > 0.999, cos.min()
    top2 = ref.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * diff.flatten()
    assert torch.equal(got.argmax(1)[clear], ref.argmax(1)[clear])


@pytest.mark.int8_matrix_unit
@pytest.mark.card(CARD, "the-w8a8-c-decode-step-gives-the-modules-logits-on-every-architecture")
def test_the_w8a8_c_step_gives_the_modules_logits_past_64_rows(tiny: Path, monkeypatch) -> None:
    """The same at 130 rows (w8a8 steps run here up to 256: the int4 step's cap is 64)."""
    test_the_w8a8_c_step_gives_the_modules_logits(tiny, 130, monkeypatch)


@pytest.mark.card(CARD, REFACTOR)
def test_the_row_ops_of_both_c_steps_live_in_one_header() -> None:
    """RMSNorm, RoPE, the heads' store to the pool, the bf16 rounding and the attention
    kernel's prototype: written once in `rowops.h`, included by both C steps, defined in
    neither."""
    import re

    from minisgl.kernels import cpu as cpu_native

    here = Path(cpu_native.__file__).parent
    header = (here / "rowops.h").read_text()
    shared = ("rms_norm", "rope", "heads_to_pool", "rbf", "decode_attention_bf16_paged")
    for name in shared:
        assert re.search(rf"\b{name}\(", header), name
    assert here / "rowops.h" in cpu_native.HEADERS  # a change rebuilds the kernels
    for src in ("decode_step.c", "decode_step_w8a8.c"):
        text = (here / src).read_text()
        assert '#include "rowops.h"' in text, src
        for name in shared:  # a definition or a prototype: a return type before the name
            assert not re.search(rf"^\s*(static\s+)?(inline\s+)?\w+\s+\*?{name}\(", text,
                                 re.M), (src, name)  # fmt: skip


@pytest.mark.int8_matrix_unit
@pytest.mark.card(CARD, "the-w8a8-c-decode-step-serves-batches-and-prefix-hits-with-kv-returned")
def test_the_w8a8_c_step_serves_batches_and_prefix_hits(tiny: Path, monkeypatch) -> None:
    """Batches of 1 to 24 decode rows, shared prefixes (radix hits), stop tokens and n > 1:
    every request finishes as asked, with the tokens the modules give; every KV page returns."""
    shared = random_prompts(1, 24, 24, seed=11)[0]
    prompts = [shared + p for p in random_prompts(20, 1, 9, seed=12)] + random_prompts(4, 3, 30)
    lens = [4 + i % 13 for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    outs = {}
    for mode in ("c", "modules"):
        llm = _llm(tiny, monkeypatch, mode, max_running_requests=24)
        outs[mode] = [o["token_ids"] for o in llm.generate(prompts, params)]
        if mode == "c":
            assert llm.engine.cpu_decode is not None and llm.engine.cpu_decode.steps > 0
            greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            one, again = (llm.generate([prompts[0]], greedy)[0]["token_ids"] for _ in range(2))
            assert len(one) == 12 and one == again  # again: from the radix cache
            stop = outs["c"][1][2]
            cut = llm.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=12,
                                                            stop_token_ids=[stop]))  # fmt: skip
            assert cut[0]["finish_reason"] == "stop" and cut[0]["token_ids"][-1] == stop
            sampled = llm.generate([prompts[2]] * 3, SamplingParams(
                temperature=0.8, max_tokens=8, ignore_eos=True, seed=5))  # fmt: skip
            assert all(len(o["token_ids"]) == 8 for o in sampled)
        assert_kv_clean(llm)
        del llm
    assert [len(t) for t in outs["c"]] == lens
    assert outs["c"] == outs["modules"]


@pytest.mark.int8_matrix_unit
@pytest.mark.card(CARD, "the-w8a8-c-step-runs-by-default-only-where-amx-int8-is-absent")
@pytest.mark.card(CARD, RED)
def test_the_w8a8_c_step_runs_by_default_only_without_amx_int8(tmp_path, monkeypatch) -> None:
    """`MINISGL_CPU_DECODE` unset (auto): the C step on a CPU without AMX-INT8, the modules
    (oneDNN's AMX kernels) with it, and without AVX512-BF16 / VNNI (the step's kernels would be
    plain loops); `c` runs it anywhere, `modules` nowhere; int4 models take the C step on both
    kinds."""
    _step()
    from minisgl.engine import cpu_decode

    path = write_tiny_model("llama", tmp_path / "llama", seed=3)
    monkeypatch.delenv("MINISGL_CPU_DECODE", raising=False)
    for amx, want in ((False, "w8a8"), (True, None)):
        monkeypatch.setattr(cpu_decode, "amx_int8", lambda amx=amx: amx)
        llm = LLM(str(path), dtype="bfloat16", quantization="w8a8", num_pages=64)
        got = llm.engine.cpu_decode
        assert (got.kind if got is not None else None) == want, amx
        why = cpu_decode.unsupported(llm.engine.model, llm.engine.pool, torch.device("cpu"))
        assert (why is None) == (want is not None) and (amx is False or "AMX" in why)
        monkeypatch.setenv("MINISGL_CPU_DECODE", "c")
        assert cpu_decode.unsupported(llm.engine.model, llm.engine.pool,
                                      torch.device("cpu")) is None  # fmt: skip
        monkeypatch.delenv("MINISGL_CPU_DECODE")
        int4 = LLM(str(path), dtype="bfloat16", quantization="int4", num_pages=64)
        assert int4.engine.cpu_decode is not None and int4.engine.cpu_decode.kind == "int4"
        del llm, int4
    # without AVX512-BF16 (the C head) or VNNI (the panel GEMM) auto keeps the modules
    flags = cpu_decode.cpu_flags()
    monkeypatch.setattr(cpu_decode, "amx_int8", lambda: False)
    monkeypatch.setattr(cpu_decode, "cpu_flags", lambda: flags - {"avx512_bf16"})
    llm = LLM(str(path), dtype="bfloat16", quantization="w8a8", num_pages=64)
    assert llm.engine.cpu_decode is None
    monkeypatch.setenv("MINISGL_CPU_DECODE", "c")  # asked for: the plain loops
    assert LLM(str(path), dtype="bfloat16", quantization="w8a8", num_pages=64).engine.cpu_decode
    monkeypatch.setenv("MINISGL_CPU_DECODE", "bogus")
    with pytest.raises(ValueError, match="MINISGL_CPU_DECODE"):
        LLM(str(path), dtype="bfloat16", quantization="w8a8", num_pages=64)


@pytest.mark.gate_only
@pytest.mark.bench
@pytest.mark.card(CARD, "seed-offline-and-many-short-in-w8a8-at-least-3x-hf-bf16-on-an-amd-epyc")
def test_w8a8_batched_vs_hf_bf16(metric, tmp_path) -> None:
    """`cpu_speed` on seed-offline and many-short (128 requests): minisgl w8a8 (decode steps
    through the C step) beside HF bf16 `generate`, 2 threads, medians of 2, same run."""
    from minisgl.testing.cpu_speed import run_cpu_speed

    res = run_cpu_speed(tmp_path, "w8a8", profiles="seed-offline,many-short", hf="bf16")
    for profile in ("seed-offline", "many-short"):
        mini = res[profile]["minisgl-w8a8"]["output_tok_s"]
        hf16 = res[profile]["hf-bf16"]["output_tok_s"]
        print(f"{profile}: minisgl w8a8 {mini:.1f} tok/s, HF bf16 {hf16:.1f} ({mini / hf16:.2f}x)")
        key = profile.replace("-", "_")
        metric(f"{key}_tok_s_minisgl_w8a8", mini, unit="tok/s")
        metric(f"{key}_tok_s_hf_bf16", hf16, unit="tok/s")


@pytest.mark.int8_matrix_unit
@pytest.mark.slow
@pytest.mark.card(CARD, "the-embedded-model-decodes-as-well-through-the-w8a8-c-step")
def test_the_embedded_model_decodes_as_well_through_the_w8a8_c_step(monkeypatch) -> None:
    """The embedded model in w8a8, the ten texts' first 80 tokens decoded one step a token
    (teacher-forced, 640 positions) through the C step and through the modules: perplexity
    within 0.5% and the same next token at >= 97% of the positions (measured: 15.910 both and
    1.000 on an AMD EPYC; an AMX Xeon's modules multiply on oneDNN's AMX kernels, 15.713 against
    15.731). Not a greedy answer: a 135M model's answer to one question flips with a rounding
    on some kinds, through either path alike."""
    from minisgl.benchmark.cpu_speed import (
        PPL_TEXTS,
        decode_logits,
        geometric_mean,
        perplexity_of,
        top1_agreement,
    )

    def logits(mode: str) -> tuple[list[torch.Tensor], list[list[int]]]:
        monkeypatch.setenv("MINISGL_CPU_DECODE", mode)
        llm = LLM(quantization="w8a8", dtype="bfloat16", max_seq_len_override=512)
        assert (llm.engine.cpu_decode is not None) == (mode == "c")
        ids = [llm.tokenizer.encode(t)[:80] for t in PPL_TEXTS]
        return [decode_logits(llm, i, prefix=16) for i in ids], [i[16:] for i in ids]

    (c, targets), (m, _) = logits("c"), logits("modules")
    ppl_c = geometric_mean(perplexity_of(lg, t) for lg, t in zip(c, targets, strict=True))
    ppl_m = geometric_mean(perplexity_of(lg, t) for lg, t in zip(m, targets, strict=True))
    agree = top1_agreement(c, m)
    print(f"w8a8 decode perplexity over {len(PPL_TEXTS)} texts: C step {ppl_c:.3f}, modules "
          f"{ppl_m:.3f}; the same next token at {agree:.3f} of the positions")  # fmt: skip
    assert abs(ppl_c / ppl_m - 1) <= 0.005, (ppl_c, ppl_m)
    assert agree >= 0.97, agree
