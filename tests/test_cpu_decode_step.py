"""The C decode step of int4 bf16 models and the ISA levels (card P2-005, issue 35).

A decode step runs as one C call over the decoder layers (`engine/cpu_decode.py`,
`kernels/cpu/decode_step.c`), batches of up to `cpu_decode.MAX_ROWS` requests; its int4 GEMMs
multiply the codes by per-32 int8 activations, each weight block by several activation rows. The reference is the torch modules (`MINISGL_CPU_DECODE=modules`) on the
same weights: logits close at every decode step of a teacher-forced text, the same greedy
choice where the reference's margin is not within the activations' rounding, the same quality.
`MINISGL_CPU_ISA` (`utils/cpu.py`) caps the features every path sees; the kernels are checked
at each level in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.testing.modules import require_module
from minisgl.testing.plans import batch_decode_logits
from minisgl.testing.scenarios import assert_kv_clean, random_prompts
from minisgl.testing.tiny_models import write_tiny_model

pytestmark = pytest.mark.isa_paths

CARD = "P2-005"
RED = "failing-tests-the-int4-gemv-the-c-decode-step-isa-levels-kind-keyed-gates"
GREEN = "decode-steps-of-int4-bf16-models-run-as-one-c-call"
REFACTOR = "one-reader-of-cpu-features-and-one-isa-switch-for-every-path"
ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def _int4() -> Any:
    return require_module("minisgl.kernels.cpu.int4")


def _matrix(n: int, k: int, seed: int, bias: bool) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """An `Int4Matrix` of a random [n, k] weight (any n: `Int4Linear`'s layout, without its
    packed torch copy, which needs n % 16 == 0), its weights `(code - 8) * scale + zero` in fp32
    (not rounded to bf16, as `Int4Linear.dequantize` rounds them), its bias."""
    from minisgl.quantization.packed import quantize_int4

    g = torch.Generator().manual_seed(seed)
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    w4 = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
    scales_zeros = torch.stack((w4.scale.t(), w4.zero.t()), dim=-1).bfloat16()  # [k / 32, n, 2]
    c = w4.q
    q = torch.stack((c & 15, c >> 4), dim=-1).view(n, k // 32, 32).float()
    sz = scales_zeros.float().transpose(0, 1)  # [n, k / 32, 2]
    w = ((q - 8) * sz[..., :1] + sz[..., 1:]).view(n, k)
    return _int4().Int4Matrix.of(c, scales_zeros, b), w, b


@pytest.mark.card(
    CARD, "the-int4-gemv-matches-the-de-quantized-weights-within-its-activation-rounding"
)
@pytest.mark.card(CARD, RED)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 64])
@pytest.mark.parametrize(("n", "k", "bias"), [(64, 32, False), (96, 96, True), (208, 576, False),
                                              (576, 1536, True), (67, 160, True), (3, 544, False)])  # fmt: skip
def test_int4_gemv_matches_the_dequantized_weights(rows: int, n: int, k: int, bias: bool) -> None:
    """Per-32 int8 activations: each product's error is at most half a step of its group
    (max |x| / 254) times |w|, so the result is within ~1% of the fp32 product (norm)."""
    int4 = _int4()
    w4, w, b = _matrix(n, k, seed=n + k, bias=bias)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2).bfloat16()
    got = int4.int4_gemv(x, w4).float()
    ref = x.float() @ w.t() + (0 if b is None else b.float())
    rel = (got - ref).norm() / ref.norm()
    assert got.shape == (rows, n) and rel < 0.01, float(rel)
    # a bound per element: the activations' rounding plus the output's bf16 rounding
    bound = (x.float().abs().amax() / 254) * w.abs().sum(dim=1) + ref.abs() / 128 + 1e-3
    assert bool(((got - ref).abs() <= bound).all())


@pytest.mark.card(
    CARD, "the-int4-gemv-matches-the-de-quantized-weights-within-its-activation-rounding"
)
@pytest.mark.parametrize("rows", [2, 3, 5, 8, 9, 16, 64, 131])
@pytest.mark.parametrize(("n", "k"), [(64, 64), (67, 160), (200, 576), (13, 1536)])
def test_the_multi_row_gemm_gives_each_row_its_one_row_result(rows: int, n: int, k: int) -> None:
    """Each weight block meets several activation rows at once: the codes' int32 sums are the
    one-row kernel's exactly, only the fp32 accumulation order may differ (within one bf16
    step of the output)."""
    int4 = _int4()
    w4, _, _ = _matrix(n, k, seed=rows + n, bias=True)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) * 3).bfloat16()
    got = int4.int4_gemv(x, w4).float()
    one = torch.cat([int4.int4_gemv(x[m : m + 1], w4) for m in range(rows)]).float()
    assert got.shape == (rows, n)
    assert bool(((got - one).abs() <= one.abs() / 128 + 1e-6).all()), (got - one).abs().max()


@pytest.mark.card(CARD, "the-int4-gemv-refuses-bad-input")
def test_int4_gemv_refuses_bad_input() -> None:
    int4 = _int4()
    w4, _, _ = _matrix(64, 64, seed=1, bias=False)
    x = torch.randn(2, 64).bfloat16()
    for bad, match in (
        (torch.randn(2, 64), "x"),  # fp32
        (torch.randn(2, 32).bfloat16(), "x"),  # another K
        (torch.randn(0, 64).bfloat16(), "rows"),
        (x.t().contiguous().t(), "x"),  # columns not contiguous
    ):
        with pytest.raises(ValueError, match=match):
            int4.int4_gemv(bad, w4)
    codes = torch.zeros(64, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not match"):
        int4.Int4Matrix.of(codes, torch.zeros(3, 64, 2, dtype=torch.bfloat16), None)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory) -> Path:
    return write_tiny_model(request.param, tmp_path_factory.mktemp("decode-step") / request.param,
                            seed=7)  # fmt: skip


def _llm(path: Path | None, monkeypatch: pytest.MonkeyPatch, mode: str, **kw: Any) -> Any:
    monkeypatch.setenv("MINISGL_CPU_DECODE", mode)
    if path is None:
        return LLM(dtype="bfloat16", **kw)
    return LLM(str(path), dtype="bfloat16", quantization="int4", **{"num_pages": 512, **kw})


@pytest.mark.card(CARD, "the-c-decode-step-matches-the-torch-modules-on-every-architecture")
@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, GREEN)
def test_the_c_decode_step_matches_the_modules(tiny: Path, monkeypatch) -> None:
    """Teacher-forced decode of 40 tokens after a 9-token prefill: every step's logits within
    the int8 activations' rounding of the modules' (cosine > 0.99), the same greedy token
    wherever the modules' top-2 margin exceeds the logits' difference."""
    from minisgl.benchmark.cpu_speed import decode_logits

    require_module("minisgl.engine.cpu_decode")
    ids = random_prompts(1, 49, 49, vocab=300, seed=3)[0]
    c = _llm(tiny, monkeypatch, "c")
    got = decode_logits(c, ids, prefix=9)
    assert c.engine.cpu_decode is not None and c.engine.cpu_decode.steps == 39
    ref_llm = _llm(tiny, monkeypatch, "modules")
    assert ref_llm.engine.cpu_decode is None
    ref = decode_logits(ref_llm, ids, prefix=9)
    assert got.shape == ref.shape == (40, ref.shape[1])
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=1)
    assert float(cos.min()) > 0.99, cos
    top2 = ref.topk(2, dim=1).values
    diff = (got - ref).abs().amax(dim=1)
    clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
    assert int(clear.sum()) >= 20
    assert torch.equal(got.argmax(1)[clear], ref.argmax(1)[clear])


@pytest.mark.card(CARD, "the-c-decode-step-matches-the-torch-modules-on-every-architecture")
@pytest.mark.parametrize("batch", [16, 64])
def test_the_c_decode_step_matches_the_modules_in_batches(tiny: Path, batch: int,
                                                          monkeypatch) -> None:  # fmt: skip
    """Teacher-forced decode steps of `batch` requests at once, every one through the C step:
    each row's logits within the int8 activations' rounding of the modules' (cosine > 0.99),
    the same greedy token wherever the modules' margin exceeds the difference."""
    prompts = random_prompts(batch, 14, 14, vocab=300, seed=batch)
    kw = {"num_pages": batch * 14 + 64, "max_running_requests": batch}
    c = _llm(tiny, monkeypatch, "c", **kw)
    got = batch_decode_logits(c, prompts, prefix=5)
    assert c.engine.cpu_decode is not None and c.engine.cpu_decode.steps == 8
    ref = batch_decode_logits(_llm(tiny, monkeypatch, "modules", **kw), prompts, prefix=5)
    assert got.shape == ref.shape == (9, batch, ref.shape[2])
    got, ref = got.flatten(0, 1), ref.flatten(0, 1)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=1)
    assert float(cos.min()) > 0.99, cos.min()
    top2 = ref.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (got - ref).abs().amax(dim=1)
    assert int(clear.sum()) >= ref.shape[0] // 4
    assert torch.equal(got.argmax(1)[clear], ref.argmax(1)[clear])


@pytest.mark.card(CARD, "the-c-decode-step-serves-batches-and-prefix-hits-with-kv-returned")
def test_the_c_decode_step_serves_batches_and_prefix_hits(tiny: Path, monkeypatch) -> None:
    """Batches of 1 to 16 decode rows (and larger ones through the modules), shared prefixes
    (radix hits), stop tokens and n > 1: every request finishes as asked, every KV page returns."""
    llm = _llm(tiny, monkeypatch, "c", max_running_requests=24)
    shared = random_prompts(1, 24, 24, seed=11)[0]
    prompts = [shared + p for p in random_prompts(20, 1, 9, seed=12)] + random_prompts(4, 3, 30)
    lens = [4 + i % 13 for i in range(len(prompts))]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                  for n in lens])  # fmt: skip
    assert [len(o["token_ids"]) for o in outs] == lens
    assert llm.engine.cpu_decode.steps > 0
    # alone (every step here), then again from the radix cache: the same tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    one, again = (llm.generate([prompts[0]], greedy)[0]["token_ids"] for _ in range(2))
    assert len(one) == 12 and one == again
    stop = outs[1]["token_ids"][2]
    cut = llm.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=12,
                                                    stop_token_ids=[stop]))  # fmt: skip
    assert cut[0]["finish_reason"] == "stop" and cut[0]["token_ids"][-1] == stop
    sampled = llm.generate([prompts[2]] * 3, SamplingParams(temperature=0.8, max_tokens=8,
                                                            ignore_eos=True, seed=5))  # fmt: skip
    assert all(len(o["token_ids"]) == 8 for o in sampled)
    assert_kv_clean(llm)


@pytest.mark.slow
@pytest.mark.card(CARD, "the-embedded-model-decodes-as-well-through-the-c-step")
def test_the_embedded_model_decodes_as_well_through_the_c_step(monkeypatch) -> None:
    """The default config (int4, bf16): decode perplexity of the ten texts through the C step
    within 1% of the modules' (geometric mean; measured +0.2% on an AMD EPYC, +0.7% at
    MINISGL_CPU_ISA=avx2). A single greedy answer is printed, not asserted: at the avx2 level
    the C step answered the capital of France "L'Étoile (The City of Lights) is" where the
    modules said "... is Paris" (one chaotic sample; its perplexity moved 0.7%)."""
    from minisgl.benchmark.cpu_speed import PPL_TEXTS, decode_perplexity, geometric_mean

    def quality(llm: Any) -> tuple[float, str]:
        ppl = []
        for text in PPL_TEXTS:
            ids = llm.tokenizer.encode(text)[:80]
            ppl.append(decode_perplexity(llm, ids, prefix=16))
        msgs = [[{"role": "user", "content": "What is the capital of France?"}]]
        out = llm.generate(msgs, SamplingParams(temperature=0.0, max_tokens=12))
        return geometric_mean(ppl), out[0]["text"]

    c = _llm(None, monkeypatch, "c")
    assert c.engine.quantization == "int4" and c.engine.cpu_decode is not None
    ppl_c, text_c = quality(c)
    del c
    ppl_m, _ = quality(_llm(None, monkeypatch, "modules"))
    print(f"decode perplexity over {len(PPL_TEXTS)} texts: C step {ppl_c:.3f}, modules "
          f"{ppl_m:.3f}; the capital of France: {text_c!r}")  # fmt: skip
    assert ppl_c <= ppl_m * 1.01, (ppl_c, ppl_m)


_CHILD = textwrap.dedent(
    """
    import json, torch
    import minisgl
    from minisgl.kernels import cpu as cpu_native
    from minisgl.kernels.cpu import int4
    from minisgl.quantization.linear import Int4Linear
    from minisgl.quantization.packed import quantize_int4
    from minisgl.utils.cpu import cpu_flags, isa_summary, march_flags
    from minisgl.quantization import w8a8
    g = torch.Generator().manual_seed(0)
    layer = Int4Linear(quantize_int4(torch.randn(96, 576, generator=g) * 0.05), None, torch.bfloat16)
    w = int4.Int4Matrix.of(layer.codes, layer.scales_zeros, None)
    x = torch.randn(3, 576, generator=g).bfloat16()
    xs = torch.randn(21, 576, generator=g).bfloat16()
    out = {"isa": isa_summary(), "march": list(march_flags()), "so": cpu_native.build().name,
           "gemv": int4.int4_gemv(x, w).float().tolist(), "w8a8": w8a8.w8a8_supported(),
           "gemm": int4.int4_gemv(xs, w).float().tolist(),
           "amx": "amx_tile" in cpu_flags()}
    if out["w8a8"]:
        xq = torch.randint(-127, 128, (5, 576), generator=g, dtype=torch.int8)
        wq = torch.randint(-127, 128, (64, 576), generator=g, dtype=torch.int8)
        y = w8a8.int8_gemm(xq, wq, torch.full((64,), 1.0), torch.float32)
        out["int8_exact"] = torch.equal(y, (xq.double() @ wq.double().t()).float())
    print(json.dumps(out))
    """
)


def _child(level: str) -> dict[str, Any]:
    env = {**os.environ, "MINISGL_CPU_ISA": level}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.card(CARD, "every-isa-level-builds-the-c-kernels-and-gives-the-same-results")
@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, REFACTOR)
def test_every_isa_level_builds_the_kernels_and_agrees() -> None:
    """Each level builds its own shared object and masks its features; the int4 GEMV gives the
    same numbers on VNNI and in plain loops (exact int32 sums of the same int8 codes: only the
    float accumulation order differs); oneDNN's int8 GEMM stays exact where w8a8 runs."""
    require_module("minisgl.kernels.cpu.int4")
    cpu = require_module("minisgl.utils.cpu")
    assert cpu.ISA_LEVELS == ("native", "avx512", "avx2")
    runs = {level: _child(level) for level in cpu.ISA_LEVELS}
    assert len({r["so"] for r in runs.values()}) == 3  # three builds, one per level
    assert not runs["avx512"]["amx"] and not runs["avx2"]["amx"]
    assert runs["avx2"]["isa"]["features_used"] == ["avx2"] or not runs["avx2"]["isa"]["features"]
    assert runs["avx2"]["w8a8"] is False  # no int8 matrix instructions at that level
    assert "-mno-avx512f" in runs["avx2"]["march"] and runs["native"]["march"] == []
    for key in ("gemv", "gemm"):  # 3 rows, and 21 (the multi-row kernel's blocks and tail)
        base = torch.tensor(runs["native"][key])
        for level, r in runs.items():
            assert torch.allclose(torch.tensor(r[key]), base, rtol=1e-2, atol=1e-2), (key, level)
    for level, r in runs.items():
        if r["w8a8"]:
            assert r["int8_exact"], level


@pytest.mark.card(CARD, REFACTOR)
def test_the_isa_switch_masks_flags_and_refuses_unknown_levels(monkeypatch) -> None:
    cpu = require_module("minisgl.utils.cpu")
    flags = frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"})
    monkeypatch.setattr(cpu, "native_flags", lambda: flags)
    seen = {}
    for level in (*cpu.ISA_LEVELS, " AVX2 "):
        monkeypatch.setenv("MINISGL_CPU_ISA", level)
        cpu.isa_level.cache_clear()
        cpu.cpu_flags.cache_clear()
        seen[level.strip().lower()] = cpu.cpu_flags()
    assert seen["native"] == flags
    assert seen["avx512"] == flags - {"amx_tile", "amx_int8"}
    assert seen["avx2"] == {"avx2"}
    monkeypatch.setenv("MINISGL_CPU_ISA", "avx9000")
    cpu.isa_level.cache_clear()
    with pytest.raises(ValueError, match="MINISGL_CPU_ISA must be one of native, avx512, avx2"):
        cpu.isa_level()
    monkeypatch.delenv("MINISGL_CPU_ISA")
    cpu.isa_level.cache_clear()
    cpu.cpu_flags.cache_clear()


@pytest.mark.card(CARD, "benchmark-records-name-the-cpu-kind-and-its-isa-features")
def test_benchmark_records_name_the_cpu_kind_and_features() -> None:
    from cardgate.hardware import CPU_KINDS, cpu_kind
    from minisgl.benchmark.common import machine_info

    info = machine_info()
    assert info["cpu_kind"] == cpu_kind() and info["hardware"] == f"cpu:{info['cpu_kind']}"
    if Path("/proc/cpuinfo").exists() and "avx2" in Path("/proc/cpuinfo").read_text():
        assert info["cpu_kind"] in CPU_KINDS
    assert info["isa"]["isa_level"] in ("native", "avx512", "avx2")
    assert set(info["isa"]["features_used"]) <= set(info["isa"]["features"])


@pytest.mark.gate_only
@pytest.mark.bench
@pytest.mark.requires(
    "llama_cpp", "`nox -s card -- P2-005` builds llama-cpp-python (or: nox -s llamacpp)"
)
@pytest.mark.card(
    CARD,
    "single-stream-decode-of-the-default-config-at-least-1-2x-llama-cpp-on-an-amd-epyc-1-3x-on-an-"
    "intel-amx-xeon",
)
def test_single_stream_default_config_vs_llamacpp(metric, tmp_path) -> None:
    """`cpu_speed` single profile: `LLM()` as a user gets it (config `default`) beside llama.cpp
    on the GGUF the embedded model ships, 2 threads, medians of 3, same run; the gate's rule is
    the machine's CPU kind (`worklog/gates/P2-005.yaml`)."""
    from minisgl.testing.cpu_speed import run_single_vs_llamacpp

    record = run_single_vs_llamacpp(tmp_path, "default")
    single = record["results"]["single"]
    mini, lcpp = single["minisgl-default"]["output_tok_s"], single["llamacpp"]["output_tok_s"]
    bound = record["single_stream_bound"]["default"]
    print(f"single stream on {record['machine']['cpu_kind']}: minisgl default {mini:.1f} tok/s, "
          f"llama.cpp {lcpp:.1f} ({mini / lcpp:.2f}x); {bound['weight_mb_per_token']:.1f} MB a "
          f"token, {bound['fraction_of_bound']:.0%} of the bandwidth bound")  # fmt: skip
    metric("single_stream_tok_s_minisgl_default", mini, unit="tok/s")
    metric("single_stream_tok_s_llamacpp", lcpp, unit="tok/s")
