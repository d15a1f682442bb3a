"""int8 layers at 32 rows or more, int4 at 256: one float GEMM on the de-quantized weights
(card P2-003).

`_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` are GEMV kernels: their time grows
with the row count (measured, 2 threads, AMX: [1077, 576] x [576, 3072] int8 23 ms, int4 21 ms,
against 1.8 / 2.9 ms de-quantized and through `F.linear`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl import LLM, SamplingParams
from minisgl.kernels import cpu as cpu_native
from minisgl.quantization import INT4_GROUP, linear
from minisgl.quantization.linear import Int4Linear
from minisgl.quantization.packed import quantize_int4
from minisgl.quantization.reference import fake_quantize_hf
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.quantized import count_dequantizations, int8_layer, linear_weights
from minisgl.testing.scenarios import assert_kv_clean, random_prompts
from minisgl.testing.tiny_models import write_tiny_model
from minisgl.utils.cpu import native_bf16

ITEM = "an-int8-layer-of-32-rows-or-more-runs-one-gemm-on-its-de-quantized-weights"
RED = "failing-tests-int8-layers-at-batch"


def _threshold(name: str) -> int:
    """A row threshold of `quantization.linear` (asserted, so a missing one fails red)."""
    rows = getattr(linear, name, None)
    assert rows is not None, f"quantization.linear.{name} is missing"
    return rows


def _gemm(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, int4: bool = False
) -> torch.Tensor:
    """The de-quantized GEMM as `quantization.linear` runs it: an int4 layer's bf16 without
    native bf16 (the x86-avx2 kind) widened to one fp32 GEMM and rounded once, else `F.linear`
    as it is."""
    if not int4 or x.dtype != torch.bfloat16 or native_bf16():
        return F.linear(x, w, bias)
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).bfloat16()


def min_rows() -> int:
    return _threshold("DEQUANT_MIN_ROWS")


def _graphs(run) -> int:
    """Graphs dynamo traces while `run()` calls a function compiled after a reset."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    run()
    return counters["stats"]["unique_graphs"] - before


@pytest.mark.card("P2-003", RED)
@pytest.mark.card("P2-003", ITEM)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_layer_from_min_rows_is_one_gemm_on_dequantized_weights(dtype):
    rows = min_rows()
    assert 8 <= rows <= 64  # measured crossover on the embedded model's shapes: 24-32 rows
    layer, deq, bias = int8_layer(dtype)
    g = torch.Generator().manual_seed(1)
    for m in (rows, 3 * rows + 5):
        x = torch.randn(m, 192, generator=g).to(dtype)
        out = layer(x)
        assert out.dtype == dtype and out.shape == (m, 160)
        assert torch.equal(out, _gemm(x, deq, bias))
        # and the same product as the fp32 reference, within the activation dtype's rounding
        ref = x.float() @ deq.float().t() + bias.float()
        tol = 1e-4 if dtype == torch.float32 else 0.02
        torch.testing.assert_close(out.float(), ref, atol=tol * float(ref.abs().max()), rtol=0)
    # a 3-D input (batch, seq, hidden) takes its row count
    x3 = torch.randn(2, rows, 192, generator=g).to(dtype)
    assert torch.equal(layer(x3), _gemm(x3, deq, bias))
    # one row fewer: the packed weight-only kernel, as before
    x = torch.randn(rows - 1, 192, generator=g).to(dtype)
    packed = torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.scales) + bias
    assert torch.equal(layer(x), packed)


@pytest.mark.card("P2-003", RED)
@pytest.mark.card("P2-003", ITEM)
def test_int8_layer_keeps_int8_weights_only():
    """The de-quantized weights are a temporary of the call: the layer holds int8 weights and
    its scales, nothing the size of a float copy."""
    min_rows()
    layer, _, _ = int8_layer(torch.bfloat16)
    layer(torch.randn(100, 192).bfloat16())
    big = [n for n, b in layer.named_buffers() if b is not None and b.numel() >= 160 * 192]
    assert big == ["qweight"] and layer.qweight.dtype == torch.int8


@pytest.mark.card("P2-003", ITEM)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_engine_with_long_prompts_matches_hf_on_dequantized_weights(arch, tmp_path):
    """fp32: prefill steps of 40-90 rows run the de-quantized GEMM, decode batches of 3 the
    packed kernel; greedy tokens equal HF's on the same rounded weights."""
    path = write_tiny_model(arch, tmp_path / arch, seed=0)
    llm = LLM(path, dtype="float32", quantization="int8", num_pages=1024)
    prompts = random_prompts(3, 40, 90, vocab=200, seed=5)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    ref = hf_greedy(fake_quantize_hf(load_hf_model(path), "int8"), prompts, 8)
    assert [o["token_ids"] for o in got] == ref
    assert_kv_clean(llm)


INT4_ITEM = "an-int4-layer-of-256-rows-or-more-runs-one-gemm-on-its-de-quantized-weights"
INT4_RED = "failing-tests-int4-layers-at-batch"


def int4_min_rows() -> int:
    return _threshold("INT4_DEQUANT_MIN_ROWS")


def _int4_layer(dtype: torch.dtype) -> tuple[Int4Linear, torch.Tensor, torch.Tensor]:
    w, bias = linear_weights(3)
    q = quantize_int4(w)
    # the weights the packed kernel multiplies: codes, scales and zeros in x's dtype, in fp32
    scale = q.scale.to(dtype).float().repeat_interleave(INT4_GROUP, dim=1)
    zero = q.zero.to(dtype).float().repeat_interleave(INT4_GROUP, dim=1)
    deq = ((q.codes().float() - 8) * scale + zero).to(dtype)
    return Int4Linear(q, bias, dtype), deq, bias.to(dtype)


@pytest.mark.card("P2-003", INT4_RED)
@pytest.mark.card("P2-003", INT4_ITEM)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_layer_from_min_rows_is_one_gemm_on_dequantized_weights(dtype):
    assert 64 <= int4_min_rows() <= 512  # torch ops de-quantize: in a decode step from ~256
    layer, deq, bias = _int4_layer(dtype)
    rows = layer.dequant_min_rows  # 64 for bf16 with the C pass
    g = torch.Generator().manual_seed(4)
    # bf16 without native bf16: de-quantized in fp32 at every row count; fp32: the weights are
    # kept de-quantized (the packed kernel with fp32 activations is torch's scalar loop)
    if layer.fp32_gemm or dtype == torch.float32:
        assert rows == 1
        for m in (1, 5, 64, 101):
            x = torch.randn(m, 192, generator=g).to(dtype)
            assert torch.equal(layer(x), _gemm(x, deq, bias, int4=True))
        return
    c = dtype == torch.bfloat16 and cpu_native.available(dtype)
    assert rows == (linear.INT4_C_DEQUANT_MIN_ROWS if c else int4_min_rows())
    for m in (rows, rows + 37):
        x = torch.randn(m, 192, generator=g).to(dtype)
        out = layer(x)
        assert out.dtype == dtype and out.shape == (m, 160)
        assert torch.equal(out, _gemm(x, deq, bias, int4=True))
    x = torch.randn(rows - 1, 192, generator=g).to(dtype)  # one row fewer: the packed kernel
    packed = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, layer.qweight, INT4_GROUP, layer.scales_zeros
    )
    assert torch.equal(layer(x), packed + bias)


@pytest.mark.card("P2-003", INT4_ITEM)
def test_int4_engine_with_long_prompts_matches_hf_on_dequantized_weights(tmp_path, monkeypatch):
    """fp32: a prefill step of 320+ rows runs the de-quantized GEMM; greedy tokens equal HF's
    on the same rounded weights."""
    path = write_tiny_model("llama", tmp_path / "llama", seed=0)
    llm = LLM(path, dtype="float32", quantization="int4", num_pages=1024)
    calls = []
    dequantize = Int4Linear.dequantize
    monkeypatch.setattr(Int4Linear, "dequantize", lambda self: calls.append(1) or dequantize(self))
    prompts = random_prompts(4, 80, 120, vocab=200, seed=6)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(calls) >= 4 * 2  # the prefill step's layers (two layers, four linears each)
    ref = hf_greedy(fake_quantize_hf(load_hf_model(path), "int4"), prompts, 8)
    assert [o["token_ids"] for o in got] == ref
    assert_kv_clean(llm)


@pytest.mark.card("P2-003", INT4_ITEM)
def test_single_stream_byte_count_leaves_out_the_batch_only_codes():
    from minisgl.benchmark.cpu_speed import weight_bytes_per_token

    layer, _, _ = _int4_layer(torch.bfloat16)
    model = torch.nn.ModuleDict({"proj": layer})
    read = layer.qweight.numel() * layer.qweight.element_size()
    read += layer.scales_zeros.numel() * layer.scales_zeros.element_size()
    assert layer.codes.numel() == 160 * 192 // 2
    assert weight_bytes_per_token(model) == read


C_ITEM = "a-bf16-int4-layer-de-quantizes-its-codes-in-one-c-pass"
C_RED = "failing-tests-int4-de-quantization-in-c"


def _c_dequant(name: str = "dequant_int4"):
    """`cpu_native.<name>` (asserted, so a missing one fails red); a skip without a compiler."""
    fn = getattr(cpu_native, name, None)
    assert fn is not None, f"cpu_native.{name} is missing"
    if not cpu_native.available(torch.bfloat16):
        pytest.skip("no C compiler: the torch ops de-quantize")
    return fn


@pytest.mark.card("P2-003", C_RED)
@pytest.mark.card("P2-003", C_ITEM)
@pytest.mark.parametrize("n,k", [(160, 192), (8, 32), (3072, 576)])
def test_c_int4_dequantization_is_bit_identical_to_the_torch_ops(n, k):
    dequant = _c_dequant()
    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    sz = (torch.randn(k // INT4_GROUP, n, 2, generator=g) * 0.05).bfloat16()
    sz[0, 0, 0] = 0.0  # a zero scale, an extreme one
    sz[-1, -1] = torch.tensor([3.0e38, -1.0]).bfloat16()
    c = torch.stack((codes & 15, codes >> 4), dim=-1).view(n, -1, INT4_GROUP).float()
    scale, zero = sz[..., 0].t().float()[:, :, None], sz[..., 1].t().float()[:, :, None]
    ref = ((c - 8) * scale + zero).view(n, k).bfloat16()
    out = dequant(codes, sz)
    assert out.dtype == torch.bfloat16 and out.shape == (n, k)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


@pytest.mark.card("P2-003", C_RED)
@pytest.mark.card("P2-003", C_ITEM)
def test_c_int4_dequantization_rejects_bad_shapes():
    dequant = _c_dequant()
    codes = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="shape"):
        dequant(codes, torch.zeros(3, 4, 2).bfloat16())  # 32 columns in 3 groups
    with pytest.raises(ValueError, match="shape"):
        dequant(codes, torch.zeros(1, 5, 2).bfloat16())  # scales for 5 rows, codes for 4
    with pytest.raises(ValueError, match="shape"):
        dequant(codes, torch.zeros(1, 4, 2))  # fp32 scales


@pytest.mark.card("P2-003", C_RED)
@pytest.mark.card("P2-003", C_ITEM)
def test_bf16_int4_layer_dequantizes_through_c(monkeypatch):
    dequant = _c_dequant()
    calls = []
    monkeypatch.setattr(cpu_native, "dequant_int4", lambda *a: calls.append(1) or dequant(*a))
    layer, deq, _ = _int4_layer(torch.bfloat16)
    assert torch.equal(layer.dequantize(), deq)
    assert calls == [1]


COMPILED_ITEM = "a-compiled-int8-or-int4-model-runs-its-batches-on-de-quantized-weights-with-no-compile-after-start"
COMPILED_RED = "failing-tests-compiled-quantized-layers-at-batch"


def _compiled_sizes(layer: torch.nn.Module, x: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """The layer compiled (dynamo, dynamic shapes) at 4, `rows` and `rows + 40` rows of x."""
    fn = torch.compile(layer, dynamic=True, backend="eager")
    return [fn(x[:m]) for m in (4, rows, rows + 40)]


@pytest.mark.card("P2-003", COMPILED_RED)
@pytest.mark.card("P2-003", COMPILED_ITEM)
def test_compiled_int8_layer_runs_the_dequantized_gemm_from_min_rows():
    """A compiled layer branches on its row count as the eager one does: the packed kernel
    below the threshold, the GEMM on the de-quantized weights from it on; the branch is a
    guard, so a graph serves each side (the engine keys its graphs by the same thresholds)."""
    layer, deq, bias = int8_layer(torch.bfloat16)
    rows = getattr(layer, "dequant_min_rows", None)
    assert rows == min_rows()
    x = torch.randn(rows + 40, 192).bfloat16()
    packed = torch.ops.aten._weight_int8pack_mm(x[:4], layer.qweight, layer.scales) + bias
    out: list[torch.Tensor] = []
    assert _graphs(lambda: out.extend(_compiled_sizes(layer, x, rows))) == 2
    assert torch.equal(out[0], packed)
    for m, y in zip((rows, rows + 40), out[1:], strict=True):
        assert torch.equal(y, _gemm(x[:m], deq, bias))


@pytest.mark.card("P2-003", COMPILED_RED)
@pytest.mark.card("P2-003", COMPILED_ITEM)
def test_compiled_int4_layer_runs_the_dequantized_gemm_from_min_rows():
    layer, deq, bias = _int4_layer(torch.bfloat16)
    rows = layer.dequant_min_rows
    if layer.fp32_gemm:  # without native bf16: no packed side (its own test: rows == 1)
        x = torch.randn(41, 192).bfloat16()
        compiled = torch.compile(layer, dynamic=True)
        for m in (1, 41):
            assert torch.equal(compiled(x[:m]), _gemm(x[:m], deq, bias, int4=True))
        return
    x = torch.randn(rows + 40, 192).bfloat16()
    packed = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x[:4], layer.qweight, INT4_GROUP, layer.scales_zeros
    )
    out: list[torch.Tensor] = []
    assert _graphs(lambda: out.extend(_compiled_sizes(layer, x, rows))) == 2
    assert torch.equal(out[0], packed + bias)
    for m, y in zip((rows, rows + 40), out[1:], strict=True):
        assert torch.equal(y, _gemm(x[:m], deq, bias, int4=True))


@pytest.mark.card("P2-003", COMPILED_RED)
@pytest.mark.card("P2-003", COMPILED_ITEM)
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_compiled_quantized_engine_batches_on_dequantized_weights(
    quantization, tmp_path, monkeypatch
):
    """fp32 (int8 layers de-quantize from 32 rows here, 256 by default; int4 layers keep fp32
    weights de-quantized once, so they de-quantize at no step): the
    start compiles every graph; prefill steps of 4, 16-24 and 300+ rows and decode batches of
    1, 8 and 40 then run with no compile, batches of 32+ rows through the de-quantized weights at run time, and
    the greedy tokens equal HF's on the same rounded weights."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(linear, "INT4_DEQUANT_MIN_ROWS", 32)
    path = write_tiny_model("llama", tmp_path / "llama", seed=0)
    llm = LLM(path, dtype="float32", quantization=quantization, enable_torch_compile=True,
              num_pages=2048, max_seq_len_override=512)  # fmt: skip
    graphs = counters["stats"]["unique_graphs"]
    calls = count_dequantizations(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    batches = [random_prompts(1, 4, 4, vocab=200, seed=7), random_prompts(8, 2, 3, vocab=200, seed=8),
               random_prompts(40, 3, 12, vocab=200, seed=9), random_prompts(1, 300, 300, vocab=200, seed=10)]  # fmt: skip
    seen = []
    for prompts in batches:
        calls.clear()
        got = llm.generate(prompts, params)
        seen.append(len(calls))
        ref = hf_greedy(fake_quantize_hf(load_hf_model(path), quantization), prompts, 4)
        assert [o["token_ids"] for o in got] == ref
    assert counters["stats"]["unique_graphs"] == graphs, "serving compiled a new graph"
    # batch 1 and 8: the packed kernels; 40 requests: prefill and 3 decode steps de-quantize
    # (4 linears a layer, 2 layers); one 300-token prompt: its prefill only
    if quantization == "int4":  # fp32 int4 layers keep their weights de-quantized from load
        assert seen == [0, 0, 0, 0]
        return
    assert seen[:2] == [0, 0]
    assert seen[2] >= 4 * 8 and seen[3] >= 8
    assert_kv_clean(llm)


C8_ITEM = "a-bf16-int8-layer-de-quantizes-its-weights-in-one-c-pass"
C8_RED = "failing-tests-int8-de-quantization-in-c"


def _c_dequant_int8():
    return _c_dequant("dequant_int8")


@pytest.mark.card("P2-003", C8_RED)
@pytest.mark.card("P2-003", C8_ITEM)
@pytest.mark.parametrize("n,k", [(160, 192), (3, 7), (3072, 576)])
def test_c_int8_dequantization_is_bit_identical_to_the_torch_ops(n, k):
    """`qweight * scales[:, None]` in bf16 (each int8 value exact in bf16, the product rounded
    once), including widths that are not a multiple of the vector length."""
    dequant = _c_dequant_int8()
    g = torch.Generator().manual_seed(n * k)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s = (torch.rand(n, generator=g) * 0.02).bfloat16()
    s[0] = 0.0
    s[-1] = 3.0e38 if n > 1 else s[-1]  # products past bf16's range: inf, as torch gives
    out = dequant(q, s)
    ref = q * s[:, None]
    assert out.dtype == torch.bfloat16 and out.shape == (n, k)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


@pytest.mark.card("P2-003", C8_ITEM)
@pytest.mark.parametrize("rows,cols", [(0, 16), (4, 0)])
def test_c_dequantization_names_an_empty_matrix(rows, cols):
    """An empty weight is refused as empty (not as a shape the int4 groups do not divide), by
    the int8 pass and the int4 one."""
    with pytest.raises(ValueError, match="dequant_int8: an empty matrix"):
        _c_dequant_int8()(torch.zeros(rows, cols, dtype=torch.int8), torch.zeros(rows).bfloat16())
    codes = torch.zeros(rows, cols // 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="dequant_int4: an empty matrix"):
        _c_dequant("dequant_int4")(codes, torch.zeros(1, rows, 2).bfloat16())


@pytest.mark.card("P2-003", C8_RED)
@pytest.mark.card("P2-003", C8_ITEM)
def test_c_int8_dequantization_rejects_bad_shapes():
    dequant = _c_dequant_int8()
    q = torch.zeros(4, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="shape"):
        dequant(q, torch.zeros(5).bfloat16())  # scales for 5 rows, weights for 4
    with pytest.raises(ValueError, match="shape"):
        dequant(q, torch.zeros(4))  # fp32 scales
    with pytest.raises(ValueError, match="shape"):
        dequant(q.to(torch.uint8), torch.zeros(4).bfloat16())


@pytest.mark.card("P2-003", C8_RED)
@pytest.mark.card("P2-003", C8_ITEM)
def test_bf16_int8_layer_dequantizes_through_c(monkeypatch):
    dequant = _c_dequant_int8()
    calls = []
    monkeypatch.setattr(cpu_native, "dequant_int8", lambda *a: calls.append(1) or dequant(*a))
    layer, deq, bias = int8_layer(torch.bfloat16)
    x = torch.randn(layer.dequant_min_rows, 192).bfloat16()
    assert torch.equal(layer(x), _gemm(x, deq, bias))
    assert calls == [1]


@pytest.mark.card("P2-003", ITEM)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_large_layer_multiplies_a_block_of_rows_at_a_time(kind, monkeypatch):
    """Above `DEQUANT_BLOCK_BYTES` of de-quantized weights (the embedded model's lm_head: 57
    MB in bf16) a layer de-quantizes and multiplies blocks of output rows: 160 rows in blocks
    of 64 here; the same product as one GEMM, within fp32 rounding."""
    monkeypatch.setattr(linear, "DEQUANT_BLOCK_BYTES", 64 * 192 * 4)
    layer, deq, bias = int8_layer(torch.float32) if kind == "int8" else _int4_layer(torch.float32)
    monkeypatch.setattr(layer, "dequant_min_rows", 8)
    blocks = []
    dequantize = layer.dequantize
    monkeypatch.setattr(layer, "dequantize", lambda rows: blocks.append(rows) or dequantize(rows))
    x = torch.randn(40, 192)
    out = layer(x)
    assert blocks == [slice(0, 64), slice(64, 128), slice(128, 160)]
    torch.testing.assert_close(out, _gemm(x, deq, bias), atol=1e-5, rtol=1e-5)
