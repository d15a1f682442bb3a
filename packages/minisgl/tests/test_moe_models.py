"""Issue 63 item 2: mixture-of-experts models (Qwen3-MoE, Mixtral) from HF folders: the config's
MoE fields, the MoE block against HF's, fp32 greedy decoding token-identical to HF `generate`
(single, batched, chunked prefill, prefix hits, both control planes, tp=2 over gloo), dummy
weights, int8 / int4 experts against HF on the same rounded weights, w8a8 refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.config import ModelConfig
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.scenarios import assert_kv_clean, random_prompts
from minisgl.testing.tiny_models import MOE_ARCHITECTURES, write_tiny_model

CARD = "P2-008"
RED = "moe-tests-fail-before-the-moe-models-exist"
GREEN = "moe-tests-pass"
NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
MODELS = Path(__file__).resolve().parents[3] / "worklog" / "models"


@pytest.fixture(params=MOE_ARCHITECTURES)
def moe_arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def hf_cache():
    cache: dict = {}

    def get(path):
        if path not in cache:
            cache[path] = load_hf_model(path)
        return cache[path]

    return get


def cpu_llm(path, **kw) -> LLM:
    kw.setdefault("num_pages", 4096 // kw.get("page_size", 1))
    return LLM(path, device="cpu", dtype="float32", **kw)


@pytest.mark.card(CARD, "the-config-reads-experts-top-k-and-the-sparse-layers", RED, GREEN)
def test_config_reads_the_moe_fields(tiny_model_dir, tmp_path):
    q = ModelConfig.from_dir(tiny_model_dir("qwen3_moe"))
    assert q.architecture == "Qwen3MoeForCausalLM" and q.qk_norm
    assert q.moe is not None
    assert (q.moe.num_experts, q.moe.top_k, q.moe.intermediate_size) == (8, 3, 32)
    assert q.moe.norm_topk_prob is True
    assert q.moe.sparse_layers == (0, 1, 3)  # mlp_only_layers=[2]: layer 2 is a dense MLP
    assert q.intermediate_size == 128  # the dense layers' MLP
    m = ModelConfig.from_dir(tiny_model_dir("mixtral"))
    assert m.architecture == "MixtralForCausalLM" and not m.qk_norm
    assert (m.moe.num_experts, m.moe.top_k, m.moe.intermediate_size) == (4, 2, 64)
    assert m.moe.norm_topk_prob is True  # Mixtral always renormalises its top-k
    assert m.moe.sparse_layers == (0, 1)
    assert m.sliding_window == 48
    # the published key names (num_experts, decoder_sparse_step) of a Qwen3-MoE config.json
    raw = json.loads((tiny_model_dir("qwen3_moe") / "config.json").read_text())
    raw.pop("num_local_experts")
    raw.update(num_experts=6, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c = ModelConfig.from_dir(tmp_path)
    assert c.moe.num_experts == 6 and c.moe.norm_topk_prob is False
    assert c.moe.sparse_layers == (1,)  # layers 1 and 3 by the step, 3 dense by the list
    dense = ModelConfig.from_dir(tiny_model_dir("qwen3"))
    assert dense.moe is None


@pytest.mark.card(CARD, "the-moe-block-equals-hf-s-sparse-block", RED, GREEN)
def test_moe_block_matches_hf(moe_arch, tiny_model_dir, hf_cache):
    from minisgl.models.loader import load_model
    from minisgl.models.moe import SparseMoeBlock

    path = tiny_model_dir(moe_arch)
    cfg = ModelConfig.from_dir(path)
    ours = load_model(path, cfg, torch.float32, torch.device("cpu"), 64)
    hf = hf_cache(path)
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for i in range(cfg.num_layers):
        mine = ours.model.layers[i].mlp
        assert isinstance(mine, SparseMoeBlock) == (i in cfg.moe.sparse_layers)
        theirs = getattr(hf.model.layers[i], "mlp", None) or hf.model.layers[i].block_sparse_moe
        with torch.inference_mode():
            want = theirs(x[None])
            want = want[0] if isinstance(want, tuple) else want
            got = mine(x)
        torch.testing.assert_close(got, want.reshape(got.shape), rtol=1e-5, atol=1e-6)
    if moe_arch == "qwen3_moe":  # every expert got tokens: the grouping is really exercised
        block = ours.model.layers[0].mlp
        with torch.inference_mode():
            _, experts = block.route(x)
        assert set(experts.flatten().tolist()) == set(range(cfg.moe.num_experts))


@pytest.mark.card(CARD, "greedy-decoding-token-identical-to-hf-single-and-batched", RED, GREEN)
@pytest.mark.parametrize("page_size", [1, 16])
def test_single_and_mixed_batch(moe_arch, page_size, tiny_model_dir, hf_cache):
    path = tiny_model_dir(moe_arch)
    prompts = random_prompts(5, 2, 70, seed=1)
    ref = hf_greedy(hf_cache(path), prompts, NEW)
    llm = cpu_llm(path, page_size=page_size)
    single = llm.generate([prompts[0]], GREEDY)
    assert single[0]["token_ids"] == ref[0]
    batch = llm.generate(prompts, GREEDY)
    assert [o["token_ids"] for o in batch] == ref
    assert_kv_clean(llm)


@pytest.mark.card(CARD, "chunked-prefill-and-prefix-hits-stay-token-identical", RED, GREEN)
def test_chunked_prefill_and_prefix_hits(moe_arch, tiny_model_dir, hf_cache):
    path = tiny_model_dir(moe_arch)
    prefix = random_prompts(1, 70, 70, seed=3)[0]
    long = random_prompts(2, 90, 130, seed=2)  # past Mixtral's window of 48
    prompts = [*long, *(prefix + tail for tail in random_prompts(3, 3, 20, seed=4))]
    ref = hf_greedy(hf_cache(path), prompts, NEW)
    llm = cpu_llm(path, max_extend_tokens=24)
    out = llm.generate(prompts[:3], GREEDY)
    assert llm.scheduler.stats.steps > NEW + 130 // 24  # the prompts really went in chunks
    assert llm.scheduler.stats.cached_prompt_tokens == 0
    rest = llm.generate(prompts[3:], GREEDY)
    assert llm.scheduler.stats.cached_prompt_tokens >= 2 * 70  # both reused the prefix
    assert [o["token_ids"] for o in out + rest] == ref
    assert_kv_clean(llm)


@pytest.mark.card(CARD, "the-rust-service-control-plane-serves-moe-models", RED, GREEN)
def test_rust_service_control_plane(moe_arch, tiny_model_dir, hf_cache):
    path = tiny_model_dir(moe_arch)
    prompts = random_prompts(4, 2, 60, seed=5)
    ref = hf_greedy(hf_cache(path), prompts, NEW)
    llm = cpu_llm(path, cpu_backend="rust_service", max_extend_tokens=32)
    try:
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY)] == ref
        assert [o["token_ids"] for o in llm.generate(prompts[:2], GREEDY)] == ref[:2]  # hits
    finally:
        llm.close()


@pytest.mark.card(CARD, "qwen3-moe-without-top-k-renormalisation-and-a-sparse-step", RED, GREEN)
def test_qwen3_moe_variant_flags(tmp_path):
    path = write_tiny_model("qwen3_moe", tmp_path / "m", seed=7, norm_topk_prob=False,
                            decoder_sparse_step=2, mlp_only_layers=[])  # fmt: skip
    assert ModelConfig.from_dir(path).moe.sparse_layers == (1, 3)
    prompts = random_prompts(3, 5, 40, seed=6)
    ref = hf_greedy(load_hf_model(path), prompts, NEW)
    out = cpu_llm(path).generate(prompts, GREEDY)
    assert [o["token_ids"] for o in out] == ref


@pytest.mark.card(CARD, "tp-2-splits-each-expert-s-intermediate-dimension", RED, GREEN)
def test_tp2_matches_hf(moe_arch, tiny_model_dir, hf_cache):
    path = tiny_model_dir(moe_arch)
    prompts = random_prompts(4, 2, 70, seed=3)
    ref = hf_greedy(hf_cache(path), prompts, NEW)
    llm = LLM(path, tp_size=2, num_pages=2048, max_extend_tokens=24, dtype="float32")
    try:
        gate_up = llm.engine.model.model.layers[0].mlp.experts.gate_up_proj
        cfg = ModelConfig.from_dir(path)
        # rank 0 holds half of every expert's intermediate rows (gate and up halves)
        assert tuple(gate_up.shape) == (cfg.moe.num_experts, cfg.moe.intermediate_size,
                                        cfg.hidden_size)  # fmt: skip
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY)] == ref
        longer = [[*p, 7, 8, 9] for p in prompts[:2]]
        out = llm.generate(longer, GREEDY)
        assert [o["token_ids"] for o in out] == hf_greedy(hf_cache(path), longer, NEW)
        assert_kv_clean(llm)
    finally:
        llm.close()


@pytest.mark.card(CARD, "dummy-weights-fill-the-stacked-experts-the-same-on-every-rank", RED, GREEN)
def test_dummy_weights_fill_the_experts(tmp_path, tiny_model_dir):
    from minisgl.distributed.layout import TPInfo
    from minisgl.models.loader import load_model

    src = tiny_model_dir("qwen3_moe")
    cfg = ModelConfig.from_dir(src)
    cpu = torch.device("cpu")
    whole = load_model("", cfg, torch.float32, cpu, 64, dummy_weights=True)
    ranks = [load_model("", cfg, torch.float32, cpu, 64, dummy_weights=True, tp=TPInfo(r, 2))
             for r in range(2)]  # fmt: skip
    gu = whole.model.layers[0].mlp.experts.gate_up_proj.detach()
    down = whole.model.layers[0].mlp.experts.down_proj.detach()
    n = cfg.moe.intermediate_size
    assert tuple(gu.shape) == (8, 2 * n, cfg.hidden_size)
    assert 0.15 < float(gu.std()) < 0.25  # N(0, initializer_range=0.2)
    assert not torch.equal(gu[0], gu[1])  # every expert its own values
    for r, model in enumerate(ranks):
        mine = model.model.layers[0].mlp.experts
        half = slice(r * n // 2, (r + 1) * n // 2)
        assert torch.equal(mine.gate_up_proj[:, : n // 2], gu[:, :n][:, half])  # gate rows
        assert torch.equal(mine.gate_up_proj[:, n // 2 :], gu[:, n:][:, half])  # up rows
        assert torch.equal(mine.down_proj, down[:, :, half])
        router = model.model.layers[0].mlp.gate.weight
        assert torch.equal(router, whole.model.layers[0].mlp.gate.weight)  # replicated
    # a config-only folder generates through the engine
    folder = tmp_path / "cfg"
    folder.mkdir()
    for f in src.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    out = cpu_llm(folder, dummy_weights=True).generate([[5, 6, 7]], GREEDY)
    assert len(out[0]["token_ids"]) == NEW


@pytest.mark.card(CARD, "the-shipped-30b-a3b-config-parses", RED, GREEN)
def test_shipped_30b_a3b_config():
    cfg = ModelConfig.from_dir(MODELS / "Qwen3-30B-A3B")
    assert cfg.architecture == "Qwen3MoeForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        48, 2048, 32, 4, 128)  # fmt: skip
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (128, 8, 768)
    assert cfg.moe.norm_topk_prob and cfg.moe.sparse_layers == tuple(range(48))
    assert cfg.rope_theta == 1e6 and not cfg.tie_word_embeddings


@pytest.mark.card(CARD, "int8-and-int4-experts-match-hf-on-the-rounded-weights", RED, GREEN)
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_match_hf(moe_arch, method, tiny_model_dir):
    """fp32 activations: the packed kernels compute what HF computes with each expert's weights
    rounded the same way, so greedy decoding is token-identical."""
    from minisgl.quantization.experts import QuantizedExperts
    from minisgl.quantization.linear import Int4Linear, Int8Linear
    from minisgl.quantization.reference import fake_quantize_hf

    path = tiny_model_dir(moe_arch)
    llm = LLM(path, dtype="float32", quantization=method, num_pages=1024)
    assert llm.engine.quantization == method
    block = llm.engine.model.model.layers[0].mlp
    assert isinstance(block.experts, QuantizedExperts)
    want = Int4Linear if method == "int4" else Int8Linear
    assert all(isinstance(m, want) for m in (*block.experts.gate_up_proj, *block.experts.down_proj))
    assert isinstance(block.gate, torch.nn.Linear)  # the router stays float
    prompts = random_prompts(4, 3, 40, seed=3)
    got = llm.generate(prompts, GREEDY)
    ref = hf_greedy(fake_quantize_hf(load_hf_model(path), method), prompts, NEW)
    assert [o["token_ids"] for o in got] == ref
    assert ref != hf_greedy(load_hf_model(path), prompts, NEW)  # the rounding is really there


@pytest.mark.card(CARD, "w8a8-of-a-moe-model-is-a-clear-error", RED, GREEN)
def test_w8a8_refused(tiny_model_dir):
    from minisgl.quantization.load import load_quantized

    path = tiny_model_dir("mixtral")
    cfg = ModelConfig.from_dir(path)
    with pytest.raises(ValueError, match="w8a8.*mixture-of-experts.*'int8' or 'int4'"):
        load_quantized(path, cfg, torch.float32, torch.device("cpu"), 64, "w8a8")


@pytest.mark.card(CARD, "tp-not-dividing-the-expert-intermediate-size-is-a-clear-error", RED, GREEN)
def test_tp_must_divide_the_expert_size(tmp_path):
    from minisgl.config import EngineConfig
    from minisgl.distributed.layout import check_tp

    path = write_tiny_model("qwen3_moe", tmp_path / "m", moe_intermediate_size=30)
    cfg = ModelConfig.from_dir(path)
    config = EngineConfig(model_path=str(path), tp_size=4)
    with pytest.raises(ValueError, match="expert intermediate size 30"):
        check_tp(cfg, config, "cpu", device_count=None, backend_available=lambda _: True)
