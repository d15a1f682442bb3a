"""Compiled decode steps of a bf16 int8 model on an AMX CPU read the int8 weights at every
batch size (card P2-003): inside the frozen decode graphs an int8 layer calls the packed kernel
at any row count and inductor replaces it by its AMX weight-only int8 GEMM template, where
eager and prefill steps from 32 rows multiply de-quantized bf16 copies (a float copy of every
weight, made again each step). Without AMX (or in fp32) nothing changes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from minisgl import LLM, SamplingParams
from minisgl.engine import compiled
from minisgl.quantization import linear
from minisgl.quantization.linear import Int4Linear
from minisgl.quantization.packed import quantize_int4
from minisgl.testing.quantized import count_dequantizations, int8_layer
from minisgl.testing.scenarios import assert_kv_clean, random_prompts
from minisgl.testing.tiny_models import write_tiny_model
from minisgl.utils.cpu import amx_tiles

ITEM = "a-compiled-bf16-int8-model-decodes-its-batches-on-the-int8-weights"
RED = "failing-tests-int8-decode-batches-in-frozen-graphs"
AMX = amx_tiles()


def _frozen_graphs() -> Any:
    fn = getattr(linear, "frozen_graphs", None)
    assert fn is not None, "quantization.linear.frozen_graphs is missing"
    return fn


class _Model(torch.nn.Module):
    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


@pytest.mark.card("P2-003", RED)
@pytest.mark.card("P2-003", ITEM)
def test_decode_graph_options_autotune_the_int8_template_alone_at_batch():
    """An int8 bf16 model's decode graph for 32 rows and up autotunes its GEMMs on AMX (the
    template, ATen's kernel for a shape it refuses); fp32 int8 there: no autotune
    (de-quantized GEMMs); int4: the template and ATen below 64 rows, nothing from there (nor
    anywhere without native bf16).
    (The name is the red commit's: the graph allowed the template alone then.)"""
    bf16 = _Model(int8_layer(torch.bfloat16, seed=3)[0])
    fp32 = _Model(int8_layer(torch.float32, seed=3)[0])
    w4 = quantize_int4(torch.randn(128, 64, generator=torch.Generator().manual_seed(0)))
    int4 = _Model(Int4Linear(w4, None, torch.bfloat16))
    cpu = torch.device("cpu")

    def backends(model: torch.nn.Module, rows: int) -> str | None:
        return compiled._options(model, cpu, rows).get("max_autotune_gemm_backends")

    assert backends(bf16, 2) == "CPP,ATEN"
    assert backends(bf16, 32) == ("CPP,ATEN" if AMX else None)
    assert backends(fp32, 2) == "CPP,ATEN" and backends(fp32, 32) is None
    # int4 bf16 without native bf16 (x86-avx2): de-quantized in fp32 at every row count
    assert backends(int4, 2) == (None if int4.layer.fp32_gemm else "CPP,ATEN")
    assert backends(int4, 64) is None
    assert getattr(bf16.layer, "packed_when_frozen", None) is AMX
    assert getattr(fp32.layer, "packed_when_frozen", None) is False
    assert getattr(int4.layer, "packed_when_frozen", None) is False


@pytest.mark.card("P2-003", RED)
@pytest.mark.card("P2-003", ITEM)
def test_frozen_bf16_int8_layer_multiplies_the_int8_weights_at_any_batch(monkeypatch):
    """Compiled as the decode graphs are (frozen, the options of the 32-row class) and run
    inside `frozen_graphs`, a bf16 int8 layer de-quantizes nothing at 40 and 100 rows and
    gives the de-quantized product within bf16 rounding; outside them the eager layer still
    de-quantizes from 32 rows."""
    frozen_graphs = _frozen_graphs()
    layer, deq, bias = int8_layer(torch.bfloat16, seed=3)
    model = _Model(layer)
    calls = count_dequantizations(monkeypatch)
    torch._dynamo.reset()
    options = compiled._options(model, torch.device("cpu"), 32)
    fn = torch.compile(model, dynamic=True, options=options)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for m in (40, 100):
            x = torch.randn(m, 192, generator=g).bfloat16()
            with torch._inductor.config.patch(freezing=True), frozen_graphs():
                out = fn(x)
            ref = x.float() @ deq.float().t() + bias.float()
            assert out.dtype == torch.bfloat16 and out.shape == (m, 160)
            tol = 0.02 * float(ref.abs().max())
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=0)
        assert not calls if AMX else calls  # without AMX: de-quantized as before
        calls.clear()
        x = torch.randn(40, 192, generator=g).bfloat16()
        assert torch.equal(layer(x), F.linear(x, deq, bias)) and calls == ["int8"]


class _DecodeGate:
    """The engine's `CompiledDecode` with `gate[0]` set during its calls."""

    def __init__(self, inner: Any, gate: list[bool]) -> None:
        self._inner, self._gate = inner, gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, *args: Any) -> torch.Tensor:
        self._gate[0] = True
        try:
            return self._inner(*args)
        finally:
            self._gate[0] = False


@pytest.mark.card("P2-003", RED)
@pytest.mark.card("P2-003", ITEM)
def test_compiled_bf16_int8_engine_decodes_batches_on_int8_weights(tmp_path, monkeypatch):
    """bf16 int8, compiled: the start compiles every graph; a batch of 40 requests then
    decodes through the graphs with no de-quantization (on AMX) and no compile; its greedy
    tokens agree with the eager engine's (bf16: other kernels' rounding flips near ties of
    the random model, the compiled prefill's too, which this change leaves as it was: 38 of
    40 first tokens equal; so agreement, not identity); KV pages all return."""
    from torch._dynamo.utils import counters

    _frozen_graphs()
    path = write_tiny_model("llama", tmp_path / "llama", seed=0)
    kwargs: dict[str, Any] = dict(dtype="bfloat16", quantization="int8", num_pages=2048,
                                  max_seq_len_override=512)  # fmt: skip
    llm = LLM(path, enable_torch_compile=True, **kwargs)
    graphs = counters["stats"]["unique_graphs"]
    gate = [False]
    calls = count_dequantizations(monkeypatch, lambda: gate[0])
    llm.engine.compiled = _DecodeGate(llm.engine.compiled, gate)
    steps = llm.engine.compiled.steps
    prompts = random_prompts(40, 3, 12, vocab=200, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    got = [o["token_ids"] for o in llm.generate(prompts, params)]
    assert llm.engine.compiled.steps - steps == 3  # the decode steps ran compiled
    assert counters["stats"]["unique_graphs"] == graphs, "serving compiled a new graph"
    assert not calls if AMX else calls, calls  # without AMX: de-quantized as before
    assert_kv_clean(llm)
    eager = LLM(path, **kwargs)
    ref = [o["token_ids"] for o in eager.generate(prompts, params)]
    same = sum(a == b for a, b in zip(got, ref, strict=True))
    assert same >= 36, f"{same}/40 prompts identical to the eager engine"


@pytest.mark.card("P2-003", ITEM)
def test_each_row_class_autotunes_its_own_graph_with_the_graph_cache_on(tmp_path, monkeypatch):
    """The decode graphs of the 2-31 and the 32+ row classes of a bf16 int8 model trace the
    same FX graph (the packed kernel at every count) and must autotune at their own size hints:
    with inductor's FX graph cache on, the 32+ class had been served the 2-row class's artifact
    (on the embedded model ATen's packed GEMV, which wins at 2 rows, then ran in every layer of
    a batch-128 step: 37 -> 161 ms). A start in an empty cache hits it for no graph. (Which
    kernel autotune picks for this tiny model's shapes depends on timings, so that is not
    asserted.)"""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # empty
    path = write_tiny_model("llama", tmp_path / "llama", seed=0)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    with torch._inductor.config.patch(fx_graph_cache=True):
        llm = LLM(path, enable_torch_compile=True, dtype="bfloat16", quantization="int8",
                  num_pages=2048, max_seq_len_override=512)  # fmt: skip
    assert counters["inductor"]["fxgraph_cache_hit"] == hits, "a class got another's graph"
    prompts = random_prompts(40, 3, 12, vocab=200, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    steps = llm.engine.compiled.steps
    llm.generate(prompts, params)
    assert llm.engine.compiled.steps - steps == 2  # batch-40 decode steps, compiled
    assert_kv_clean(llm)
