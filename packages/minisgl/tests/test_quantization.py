"""Weight-only int8 / int4 quantization: packed kernels against the de-quantized reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minisgl import LLM, SamplingParams
from minisgl.config import EngineConfig
from minisgl.quantization.gguf import (
    _q4_0,
    _q4_1,
    _q4_k,
    _q8_0,
    _q8_0_int8,
    _unpermute_rows,
)
from minisgl.quantization.linear import Int4Linear, Int8Embedding, Int8Linear
from minisgl.quantization.packed import quantize_int4, quantize_int8
from minisgl.quantization.reference import fake_quantize_hf
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.scenarios import random_prompts


def _weights(n: int = 96, k: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.3


def test_int4_round_trip_error_is_at_most_half_a_step():
    w = _weights()
    q = quantize_int4(w)
    err = (q.dequantize() - w).abs().view(96, 4, 32)
    assert q.q.dtype == torch.uint8 and q.q.shape == (96, 64)
    assert bool((err <= q.scale[..., None] / 2 + 1e-6).all())
    assert int(q.codes().max()) <= 15 and int(q.codes().min()) >= 0


def test_int8_round_trip_error_is_at_most_half_a_step():
    w = _weights()
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8
    assert bool(((q.dequantize() - w).abs() <= q.scale[:, None] / 2 + 1e-6).all())


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_dequantized_matmul(method, dtype):
    w, bias = _weights(), torch.randn(96) * 0.1
    x = torch.randn(5, 3, 128)
    q = quantize_int4(w) if method == "int4" else quantize_int8(w)
    layer = (Int4Linear if method == "int4" else Int8Linear)(q, bias, dtype)
    ref = x.to(dtype).float() @ q.dequantize().t() + bias.to(dtype).float()
    out = layer(x.to(dtype))
    assert out.shape == (5, 3, 96) and out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 0.05 * float(ref.abs().max())
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=0.02 if tol > 1e-3 else 1e-4)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_an_fp32_int4_linear_is_one_fp32_gemm_on_its_dequantized_weights(rows):
    """fp32 activations: the packed int4 kernel is torch's scalar loop there (8 ms for one row
    of a 1536 x 576 layer, ~1 s a token of the embedded model, intel-amx); the layer keeps its
    weights de-quantized once in fp32 (what the user asked for: fp32 memory and arithmetic on
    the int4 model's values) and runs one GEMM at every row count."""
    w, bias = _weights(), torch.randn(96) * 0.1
    q = quantize_int4(w)
    layer = Int4Linear(q, bias, torch.float32)
    x = torch.randn(rows, 128)
    assert layer.row_thresholds == (1,)
    assert torch.equal(layer(x), F.linear(x, q.dequantize(), bias))


ROWS = 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_from_32_rows_is_one_gemm_on_the_dequantized_weights(dtype):
    w, bias = _weights(), torch.randn(96) * 0.1
    q = quantize_int8(w)
    layer = Int8Linear(q, bias, dtype)
    x = (torch.randn(ROWS, 128) * torch.linspace(0.1, 3.0, ROWS)[:, None]).to(dtype)
    exact = F.linear(x, q.q * q.scale.to(dtype)[:, None], bias.to(dtype))
    assert torch.equal(layer(x), exact)
    # one row fewer takes the weight-only packed kernel
    small = layer(x[:-1])
    packed = torch.ops.aten._weight_int8pack_mm(x[:-1], q.q, q.scale.to(dtype)) + bias.to(dtype)
    torch.testing.assert_close(small, packed)


def test_int8_embedding_reads_the_heads_rows():
    w = _weights(40, 64)
    head = Int8Linear(quantize_int8(w), None, torch.float32)
    emb = Int8Embedding(head)
    ids = torch.tensor([3, 0, 39, 3])
    assert emb.qweight.data_ptr() == head.qweight.data_ptr()  # shared, not copied
    torch.testing.assert_close(emb(ids), quantize_int8(w).dequantize()[ids])


def test_gguf_blocks_convert_exactly():
    gguf = pytest.importorskip("gguf")
    x = np.random.default_rng(0).standard_normal((16, 96)).astype(np.float32)
    kinds = gguf.GGMLQuantizationType
    raw = gguf.quants.quantize(x, kinds.Q4_1)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, kinds.Q4_1))
    assert torch.equal(_q4_1(raw, 16, 96).dequantize(), ref)  # Q4_1 -> int4: no rounding
    raw8 = gguf.quants.quantize(x, kinds.Q8_0)
    ref8 = torch.from_numpy(gguf.quants.dequantize(raw8, kinds.Q8_0))
    assert torch.equal(_q8_0(raw8, 16, 96), ref8)


def _q4_k_blocks(n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K super-blocks (any bit pattern is a valid block once d / dmin are finite):
    fp16 d and dmin, 12 bytes of packed 6-bit scales / mins, 128 bytes of nibbles."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_blocks, 144), dtype=np.uint8)
    d = (rng.random(n_blocks) * 0.01 + 1e-4).astype(np.float16)
    dmin = (rng.random(n_blocks) * 0.01).astype(np.float16)
    raw[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    raw[:, 2:4] = dmin.view(np.uint8).reshape(-1, 2)
    return raw


def test_gguf_4bit_blocks_convert_to_int4_without_rounding():
    """Q4_0 / Q4_K blocks keep their codes and scales: the int4 weight de-quantizes to exactly
    gguf-py's reference values."""
    gguf = pytest.importorskip("gguf")
    kinds = gguf.GGMLQuantizationType
    x = np.random.default_rng(1).standard_normal((16, 96)).astype(np.float32)
    raw0 = gguf.quants.quantize(x, kinds.Q4_0)
    w0 = _q4_0(raw0, 16, 96)
    assert torch.equal(w0.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw0, kinds.Q4_0)))
    assert not bool(w0.zero.any())
    n, k = 6, 512  # 2 super-blocks per row
    rawk = _q4_k_blocks(n * k // 256).reshape(n, -1)
    wk = _q4_k(rawk, n, k)
    refk = torch.from_numpy(gguf.quants.dequantize(rawk, kinds.Q4_K)).reshape(n, k)
    assert wk.q.shape == (n, k // 2) and wk.scale.shape == (n, k // 32)
    assert torch.equal(wk.dequantize(), refk)
    # the scales are the blocks' d times their 6-bit sub-block scales (0..63)
    d0 = float(torch.from_numpy(rawk[0, 0:2].copy().view(np.float16)).float())
    ratios = wk.scale[0, :8] / d0
    assert torch.equal(ratios, ratios.round()) and float(ratios.max()) <= 63


def test_read_gguf_weights_takes_q4_k_and_q8_0_blocks_directly(tmp_path):
    """A GGUF file with a Q4_K linear and a Q8_0 embedding: int4 mode serves the Q4_K codes as
    they are (no min/max re-quantization), the embedding int8 from its blocks."""
    gguf = pytest.importorskip("gguf")
    from minisgl.quantization.gguf import read_gguf_weights

    kinds = gguf.GGMLQuantizationType
    n, k = 8, 256
    rawk = _q4_k_blocks(n).reshape(n, 144)
    emb = np.random.default_rng(3).standard_normal((16, 256)).astype(np.float32)
    raw8 = gguf.quants.quantize(emb, kinds.Q8_0)
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")  # not `llama`: no Q/K row permutation
    writer.add_tensor("blk.0.ffn_down.weight", rawk, raw_dtype=kinds.Q4_K)
    writer.add_tensor("token_embd.weight", raw8, raw_dtype=kinds.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = read_gguf_weights(path, "int4", num_heads=1, num_kv_heads=1)
    down = got["model.layers.0.mlp.down_proj.weight"]
    ref = torch.from_numpy(gguf.quants.dequantize(rawk, kinds.Q4_K)).reshape(n, k)
    assert torch.equal(down.dequantize(), ref)
    e = got["model.embed_tokens.weight"]
    ref8 = quantize_int8(torch.from_numpy(gguf.quants.dequantize(raw8, kinds.Q8_0)))
    assert torch.equal(e.q, ref8.q) and torch.equal(e.scale, ref8.scale)


def test_gguf_q8_0_converts_to_int8_like_quantize_int8_of_its_values():
    gguf = pytest.importorskip("gguf")
    kinds = gguf.GGMLQuantizationType
    x = np.random.default_rng(2).standard_normal((16, 96)).astype(np.float32)
    x[3] *= 20  # rows of very different ranges
    raw8 = gguf.quants.quantize(x, kinds.Q8_0)
    got = _q8_0_int8(raw8, 16, 96)
    ref = quantize_int8(torch.from_numpy(gguf.quants.dequantize(raw8, kinds.Q8_0)))
    assert torch.equal(got.q, ref.q) and torch.equal(got.scale, ref.scale)


@pytest.mark.slow
def test_the_embedded_gguf_converts_to_the_tensors_transformers_loads(tmp_path, monkeypatch):
    """`read_gguf_float` (the cold start's one read of the file) gives every tensor of the
    embedded GGUF bit for bit as transformers' GGUF loader does, under the names its tied save
    keeps (`model.embed_tokens.weight` for the embedding); the converted folder holds them (and
    the embedding as `lm_head.weight` too, for earlier versions) and a config
    that loads as the model's (architecture, dtype, tied embeddings). The conversion parses
    the file's metadata once (config, tokenizer and weights share one reader: a parse is ~3 s
    of a ~24 s cold start on 2 cores)."""
    import json

    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from minisgl.default_model import _convert, gguf_path
    from minisgl.quantization.gguf import read_gguf_float

    g = gguf_path()
    cfg = AutoConfig.from_pretrained(str(g.parent), gguf_file=g.name)
    got = read_gguf_float(g, cfg.num_attention_heads, cfg.num_key_value_heads)
    model = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, config=cfg,
                                                 dtype=torch.float32)  # fmt: skip
    ref = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert set(got) == set(ref) and len(got) == 272
    assert not [k for k in ref if not torch.equal(got[k], ref[k])]
    parses: list[str] = []
    real = gguf.GGUFReader

    def counted(path, *args, **kwargs):
        parses.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    _convert(g, tmp_path / "m")
    assert parses == [str(g)], parses
    assert gguf.GGUFReader is counted  # restored after the conversion
    written = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert set(written) == set(got) | {"lm_head.weight"}  # the tied embedding's second name
    assert all(torch.equal(written[k], got[k]) for k in got)
    assert torch.equal(written["lm_head.weight"], got["model.embed_tokens.weight"])
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM"] and conf["dtype"] == "float32"
    assert conf["tie_word_embeddings"] is True and "quantization_config" not in conf
    assert (tmp_path / "m" / "tokenizer.json").is_file()


def test_unpermute_rows_matches_transformers():

    rows = _unpermute_rows(12, 3)  # 3 heads of 4 rows: pairs (0,1)(2,3) -> 0,2,1,3
    assert rows.tolist() == [0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11]


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_engine_matches_hf_on_the_dequantized_weights(arch, method, tiny_model_dir):
    """fp32 activations: the packed kernels compute what HF computes with the same rounded
    weights, so greedy decoding is token-identical (qwen2: QKV bias, tied embedding)."""
    path = tiny_model_dir(arch)
    llm = LLM(path, dtype="float32", quantization=method, num_pages=1024)
    assert llm.engine.quantization == method
    prompts = random_prompts(4, 3, 20, vocab=200, seed=3)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    ref = hf_greedy(fake_quantize_hf(load_hf_model(path), method), prompts, 10)
    assert [o["token_ids"] for o in got] == ref


def test_auto_is_none_for_a_safetensors_folder(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), num_pages=256)
    assert llm.engine.quantization == "none"
    assert llm.engine.dtype == torch.float32  # fp32 stays the exact default


def test_bad_quantization_is_rejected():
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(model_path="x", quantization="int3")


@pytest.fixture(scope="module")
def embedded():
    return LLM(max_seq_len_override=512)


@pytest.mark.slow
def test_embedded_model_serves_int4_and_answers_paris(embedded):
    """Through the C decode step (P2-005), int4: the deciding token of the answer. The whole
    greedy answer of a 135M model under int4 depends on the kind's rounding (intel-amx:
    "L'Étoile (The City of Lights) is the capital of France.", no Paris; amd-epyc: "...
    Paris."); after "The capital of France is" the model puts ~95% on " Paris"."""
    llm = embedded
    assert llm.engine.quantization == "int4"
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = llm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    out = llm.generate(
        [prompt + "The capital of France is"],
        SamplingParams(temperature=0.0, max_tokens=4, logprobs=2),
    )
    assert out[0]["text"].startswith(" Paris"), out[0]["text"]
    first = out[0]["logprobs"][0]
    assert first.logprob > -0.5 and first.logprob - first.top[1][1] > 2.0, first


@pytest.mark.slow
def test_embedded_int4_survives_a_batched_step_after_a_long_prefill(embedded):
    """torch 2.15's _weight_int8pack_mm segfaulted on the lm_head of a 16-request decode step
    after a ~2600-token int4 prefill: int4 mode keeps every matmul on the int4 kernel."""
    llm = embedded
    assert isinstance(llm.engine.model.lm_head, Int4Linear)
    prompts = random_prompts(16, 64, 256, vocab=20000, seed=42)
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert [len(o["token_ids"]) for o in out] == [3] * 16


def test_cpu_speed_perplexity_matches_hf_fp32(tmp_path):
    """The benchmark's one-prefill perplexity (all positions' logits) equals HF's in fp32."""
    from minisgl.benchmark.cpu_speed import perplexity_hf, perplexity_minisgl
    from minisgl.testing.tiny_models import write_tiny_model

    path = write_tiny_model("llama", tmp_path / "m", seed=0)
    llm = LLM(path, dtype="float32", num_pages=256, max_seq_len_override=128)
    ids = random_prompts(1, 40, 40, seed=1)[0]
    want = perplexity_hf(load_hf_model(path), ids)
    assert perplexity_minisgl(llm, ids) == pytest.approx(want, rel=1e-4)
