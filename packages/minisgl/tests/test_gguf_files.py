"""Any GGUF file of the four dense families as a model path (`gguf_model.py`): config and
tokenizer from its metadata, every common tensor type, served exactly at fp32 (the file's
de-quantized values, as transformers' GGUF loader reads them) and in its packed class within
the type's stated error; bad files are a ValueError offline and exit 2 at a server's start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.benchmark.cpu_speed import perplexity_of, prompt_logits
from minisgl.gguf_model import TYPE_CLASSES, GGUFError, resolve_model_path
from minisgl.testing.hf_reference import hf_greedy
from minisgl.testing.scenarios import random_prompts
from minisgl.testing.tiny_gguf import TENSOR_TYPES, write_tiny_gguf
from minisgl.testing.tiny_models import CHAT_TEMPLATE

gguf = pytest.importorskip("gguf")

CARD = "P2-007"
RED = "failing-tests-gguf-files-of-every-family-and-type"
# each type on one family, each family on three or four types
FAMILY_OF = {
    "F16": "llama", "Q4_0": "llama", "Q4_K": "llama", "Q6_K": "llama",
    "F32": "qwen2", "Q4_1": "qwen2", "Q2_K": "qwen2",
    "Q8_0": "qwen3", "Q5_0": "qwen3", "Q3_K": "qwen3",
    "BF16": "mistral", "Q5_1": "mistral", "Q5_K": "mistral",
}  # fmt: skip
# the packed class's error: |logits - reference| / |reference - its row means| (Frobenius) over
# one 48-token prompt, reference = the file's de-quantized values in fp32. Measured on these
# files (intel-amx, 2 cores): Q8_0 0.028, Q4_0 0.063 (codes exact; the untied lm_head
# re-quantized to int4), Q4_1 0.015, Q5_0 0.029, Q5_1 0.026, Q2_K 0.036, Q3_K 0.023 (int8), Q4_K 0.010,
# Q5_K 0.003, Q6_K 0.020; the float types are served unpacked: exact. Bounds about twice these.
PACKED_ERROR = {
    "F32": 1e-6, "F16": 1e-6, "BF16": 1e-6, "Q8_0": 0.06, "Q4_0": 0.12, "Q4_1": 0.03,
    "Q5_0": 0.06, "Q5_1": 0.05, "Q2_K": 0.07, "Q3_K": 0.05, "Q4_K": 0.02, "Q5_K": 0.01,
    "Q6_K": 0.04,
}  # fmt: skip
IDS = random_prompts(1, 48, 48, vocab=380, seed=1)[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """files(type) -> a tiny GGUF of FAMILY_OF[type] in that type (written once)."""
    root = tmp_path_factory.mktemp("gguf")
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = write_tiny_gguf(FAMILY_OF[kind], root / f"tiny-{kind}.gguf", kind)
        return made[kind]

    return get


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch, request):
    """Conversions of the tiny files land in a session folder, not the user's cache."""
    if "embedded" not in request.node.name:
        monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


def _reference(path: Path):
    """transformers' own GGUF load of the file (its de-quantization and Q / K un-permutation),
    fp32, with the config the conversion derived (transformers reads no head size for qwen3;
    a `mistral`-named llama file loads as the Llama it is: transformers' weight map has no
    `mistral`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    cfg = AutoConfig.from_pretrained(resolve_model_path(path))
    if cfg.model_type == "mistral":
        fields = cfg.to_dict()
        fields.pop("model_type", None)
        cfg = LlamaConfig(**fields)
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=cfg, dtype=torch.float32
    ).eval()


def _reference_logits(path: Path) -> torch.Tensor:
    with torch.inference_mode():
        return _reference(path)(torch.tensor([IDS])).logits[0, :-1]


def _llm(path: Path, quantization: str) -> LLM:
    return LLM(path, dtype="float32", quantization=quantization, num_pages=128,
               max_seq_len_override=128)  # fmt: skip


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / (ref - ref.mean(1, keepdim=True)).norm())


@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, "every-tensor-type-loads-as-its-de-quantized-values-at-fp32")
@pytest.mark.parametrize("kind", TENSOR_TYPES)
def test_every_type_loads_as_its_dequantized_values_at_fp32(kind, files):
    path = files(kind)
    llm = _llm(path, "none")
    assert llm.engine.quantization == "none"
    torch.testing.assert_close(prompt_logits(llm, IDS), _reference_logits(path),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, "auto-serves-each-type-in-its-packed-class-within-its-stated-error")
@pytest.mark.parametrize("kind", TENSOR_TYPES)
def test_auto_serves_each_type_in_its_class_within_its_stated_error(kind, files):
    path = files(kind)
    llm = _llm(path, "auto")
    assert llm.engine.quantization == TYPE_CLASSES[kind]
    err = _relative_error(prompt_logits(llm, IDS), _reference_logits(path))
    assert err <= PACKED_ERROR[kind], f"{kind}: relative logits error {err:.4f}"


@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, "config-and-tokenizer-with-its-chat-template-come-from-the-file")
@pytest.mark.parametrize("kind", ["Q4_K", "Q4_1", "Q5_0", "Q5_1"])  # one per family
def test_each_family_generates_with_the_files_tokenizer_and_template(kind, files):
    """Greedy decoding at fp32 gives the reference's tokens; the tokenizer and chat template
    are the file's (the HF folder's it was written from); the model is named after the file."""
    from transformers import AutoTokenizer

    from minisgl.config import ModelConfig
    from minisgl.default_model import served_name

    path = files(kind)
    llm = _llm(path, "none")
    family = FAMILY_OF[kind]
    cfg = ModelConfig.from_dir(llm.config.model_path)
    want_arch = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}
    assert cfg.architecture == f"{want_arch[family]}ForCausalLM"
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (64, 4, 2)
    assert served_name(llm.config.model_path) == path.stem
    original = AutoTokenizer.from_pretrained(str(path) + ".hf")
    msgs = [{"role": "user", "content": "Paris is the capital of France."}]
    assert llm.tokenizer.chat_template == CHAT_TEMPLATE
    text = llm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert llm.tokenizer.encode(text) == original.encode(text)
    prompts = random_prompts(3, 4, 20, vocab=380, seed=5)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [o["token_ids"] for o in got] == hf_greedy(_reference(path), prompts, 8)
    chat = llm.generate([msgs], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(chat[0]["token_ids"]) == 4


@pytest.mark.card(CARD, "config-and-tokenizer-with-its-chat-template-come-from-the-file")
def test_a_sentencepiece_file_serves_with_its_tokenizer(tmp_path):
    """A Mistral-style file with a SentencePiece vocabulary (`tokenizer.ggml.model` llama: pieces
    with scores, byte fallback, BOS added): prompts encode as transformers' own tokenizer of the
    file encodes them (BOS first, unknown characters as bytes), chats render with the file's
    template, and greedy decoding from text equals the reference's."""
    from transformers import AutoTokenizer

    from minisgl.testing.tiny_gguf import SPM_TEMPLATE

    path = write_tiny_gguf("mistral", tmp_path / "spm.gguf", "Q8_0", tokenizer="spm")
    llm = _llm(path, "none")
    want = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["hello the Paris is capital of France.", "  naïve 你好 [x]\n", ""]
    for text in texts:
        ids = llm.tokenizer.encode(text)
        assert ids == want(text)["input_ids"] and ids[:1] == [1], text
        assert llm.tokenizer.decode(ids, skip_special_tokens=True) == want.decode(
            ids, skip_special_tokens=True
        )
    assert llm.tokenizer.chat_template == SPM_TEMPLATE
    msgs = [{"role": "user", "content": "hello Paris"}]
    text = llm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<s>[INST] hello Paris [/INST]"
    prompts = [want(t)["input_ids"] for t in texts[:2]]
    got = llm.generate(texts[:2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [o["token_ids"] for o in got] == hf_greedy(_reference(path), prompts, 6)


@pytest.mark.card(CARD, "a-q4-k-m-style-mix-serves-int4")
def test_a_q4_k_m_style_mix_serves_int4(tmp_path):
    """llama.cpp's _M mixes: Q4_K with Q6_K ffn_down -> int4, the class of most values."""
    mix = {f"blk.{i}.ffn_down.weight": "Q6_K" for i in range(2)}
    path = write_tiny_gguf("llama", tmp_path / "mix.gguf", "Q4_K", types=mix)
    llm = _llm(path, "auto")
    assert llm.engine.quantization == "int4"
    assert _relative_error(prompt_logits(llm, IDS), _reference_logits(path)) <= 0.04


def _bad_file(tmp_path: Path, what: str) -> Path:
    import numpy as np

    path = tmp_path / f"{what}.gguf"
    if what == "text":
        path.write_text("this is no GGUF file\n")
        return path
    arch = {"arch": "gpt2", "experts": "qwen3moe"}.get(what, "llama")
    writer = gguf.GGUFWriter(str(path), arch)
    w = np.zeros((8, 32), np.float32)
    if what == "type":  # IQ4_NL: 18 bytes a block of 32
        writer.add_tensor("blk.0.attn_q.weight", np.zeros((8, 18), np.uint8),
                          raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)  # fmt: skip
    elif what == "moe":
        writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 8, 32), np.float32))
    elif what == "experts":  # a qwen3moe file whose stacked experts disagree with its keys
        writer.add_expert_count(8)
        writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 8, 32), np.float32))
    else:
        writer.add_tensor("token_embd.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


BAD = {
    "text": "not a GGUF file",
    "arch": "architecture 'gpt2' is not supported",
    "type": "type IQ4_NL, which is not supported",
    "moe": "'blk.0.ffn_gate_exps.weight' is not part of a dense llama model",
    "experts": "'blk.0.ffn_gate_exps.weight' stacks 4 experts, but qwen3moe.expert_count is 8",
}


@pytest.mark.card(CARD, RED)
@pytest.mark.card(CARD, "a-bad-file-is-a-valueerror-offline-and-exit-2-at-a-server-s-start")
@pytest.mark.parametrize("what", list(BAD))
def test_a_bad_file_is_a_valueerror_offline(what, tmp_path):
    with pytest.raises(ValueError, match=BAD[what]) as e:
        LLM(_bad_file(tmp_path, what), num_pages=64)
    assert isinstance(e.value, GGUFError)


# Llama 3.1+ files: HF's `llama3` rope scaling, stored by llama.cpp as `rope_freqs.weight` (a
# divisor per frequency); a short original context so that most of a 48-token prompt's
# frequencies are scaled
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # fmt: skip


def _hf_logits(folder: str | Path, rope_scaling: dict | None = None) -> torch.Tensor:
    """fp32 logits of an HF folder over IDS (`rope_scaling`: replace the config's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(folder))
    if rope_scaling is not None:
        cfg.rope_parameters = {**rope_scaling, "rope_theta": cfg.rope_parameters["rope_theta"]}
    model = AutoModelForCausalLM.from_pretrained(str(folder), config=cfg, dtype=torch.float32)
    with torch.inference_mode():
        return model.eval()(torch.tensor([IDS])).logits[0, :-1]


@pytest.mark.card(CARD, "failing-tests-a-llama-3-1-file-s-rope-factors")
@pytest.mark.card(CARD, "a-llama-3-1-file-s-rope-factors-serve-as-hf-s-llama3-scaling")
@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1 / 3.3, Llama 3.2
def test_a_llama3_files_rope_factors_serve_as_hfs_llama3_scaling(factor, tmp_path):
    """`rope_freqs.weight` is read back into the converted config as HF's `llama3` parameters
    (fitted to the factors, then checked to reproduce them) and served as the HF model the file
    came from: fp32 logits within 1e-5. Without the scaling they are far off."""
    scaling = {**LLAMA3, "factor": factor}
    path = write_tiny_gguf("llama", tmp_path / "llama3.gguf", "F32", rope_scaling=scaling)
    cfg = json.loads((Path(resolve_model_path(path)) / "config.json").read_text())
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    assert rope.get("rope_type") == "llama3", cfg
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        assert rope[key] == pytest.approx(scaling[key], rel=1e-4), key
    assert rope["original_max_position_embeddings"] == 64
    ref = _hf_logits(str(path) + ".hf")
    got = prompt_logits(_llm(path, "none"), IDS)
    assert _relative_error(got, ref) <= 1e-5
    plain = _hf_logits(str(path) + ".hf", {"rope_type": "default"})
    assert _relative_error(plain, ref) >= 1e-2  # the scaling matters at these positions


@pytest.mark.card(CARD, "a-llama-3-1-file-s-rope-factors-serve-as-hf-s-llama3-scaling")
@pytest.mark.parametrize(
    ("head_dim", "theta", "scaling"),
    [(128, 5e5, {**LLAMA3, "original_max_position_embeddings": 8192}),  # Llama 3.1 8B / 70B
     (64, 5e5, {**LLAMA3, "factor": 32.0, "original_max_position_embeddings": 8192}),  # 3.2 1B
     (128, 5e5, {**LLAMA3, "factor": 32.0, "original_max_position_embeddings": 8192})],  # 3.2 3B
)  # fmt: skip
def test_the_llama3_releases_divisors_fit_back_to_their_parameters(head_dim, theta, scaling):
    """The divisors llama.cpp writes for the released Llama 3 configs fit back exactly."""
    from minisgl.gguf_rope import llama3_scaling
    from minisgl.testing.tiny_gguf import llama3_rope_factors

    got = llama3_scaling(llama3_rope_factors(head_dim, theta, scaling), head_dim, theta)
    assert got == {**scaling, "rope_theta": theta}
    assert llama3_scaling([1.0] * (head_dim // 2), head_dim, theta) is None  # no scaling


@pytest.mark.card(CARD, "failing-tests-a-llama-3-1-file-s-rope-factors")
@pytest.mark.card(CARD, "a-llama-3-1-file-s-rope-factors-serve-as-hf-s-llama3-scaling")
@pytest.mark.parametrize("bad", ["shape", "values"])
def test_rope_factors_no_llama3_scaling_gives_are_refused(bad, tmp_path):
    """Factors of the wrong length, or values no `llama3` parameters reproduce (here rising
    and falling), are a GGUFError naming the tensor, offline and before any conversion."""
    import numpy as np

    factors = np.ones(7, np.float32) if bad == "shape" else np.array([1, 2, 4, 2] * 8, np.float32)
    path = write_tiny_gguf("llama", tmp_path / f"{bad}.gguf", "F32", rope_factors=factors)
    with pytest.raises(GGUFError, match="rope_freqs.weight") as e:
        LLM(path, num_pages=64)
    want = "32 values (one per frequency of a 64-dim head)" if bad == "shape" else "llama3"
    assert want in str(e.value)


@pytest.mark.card(CARD, "a-bad-file-is-a-valueerror-offline-and-exit-2-at-a-server-s-start")
@pytest.mark.parametrize("what", ["arch", "type"])
def test_a_bad_file_exits_2_at_a_servers_start(what, tmp_path, capsys):
    from minisgl.server.launch import main

    assert main(["--model-path", str(_bad_file(tmp_path, what))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minisgl: error: ") and BAD[what] in err[0]


@pytest.mark.slow
@pytest.mark.card(CARD, "the-embedded-model-from-its-own-gguf-path-equals-the-default-path")
def test_the_embedded_model_from_its_gguf_path_equals_the_default():
    """`LLM(<the embedded GGUF>)` serves what `LLM()` serves (int4, its file's class): the same
    logits and perplexity over a prefill."""
    from minisgl.default_model import gguf_path

    ids = random_prompts(1, 64, 64, vocab=20000, seed=7)[0]
    default = LLM(max_seq_len_override=256)
    want = prompt_logits(default, ids)
    del default
    own = LLM(gguf_path(), max_seq_len_override=256)
    assert own.engine.quantization == "int4"
    got = prompt_logits(own, ids)
    assert torch.equal(got, want)
    assert perplexity_of(got, ids[1:]) == perplexity_of(want, ids[1:])


# Qwen3-MoE files (`qwen3moe`: Qwen3-30B-A3B's GGUF): each layer's experts stacked in one tensor
# per projection, the router in F32, the expert shape in `expert_*` keys
MOE_ITEM = "a-qwen3-moe-file-serves-its-experts"
MOE_RED = "failing-tests-a-qwen3-moe-file"
MOE_CLASS = {"Q8_0": "int8", "Q4_K": "int4"}
# measured (amd-epyc): Q8_0 0.099 (as the HF folder the file came from, int8 against its own
# float: 0.099; a 4-expert top-2 router turns small errors into other experts), Q4_K 0.0105;
# bounds about twice these
MOE_PACKED_ERROR = {"Q8_0": 0.2, "Q4_K": 0.02}


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    """moe_files(type) -> a tiny Qwen3-MoE GGUF in that type (written once)."""
    root = tmp_path_factory.mktemp("gguf-moe")
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = write_tiny_gguf("qwen3_moe", root / f"moe-{kind}.gguf", kind)
        return made[kind]

    return get


def _served(path: Path) -> Path:
    """The file's converted folder; a refusal of the file fails the test with its message."""
    try:
        return Path(resolve_model_path(path))
    except GGUFError as e:
        pytest.fail(f"{path.name} was refused: {e}")


@pytest.mark.card(CARD, MOE_RED)
@pytest.mark.card(CARD, MOE_ITEM)
def test_a_qwen3_moe_files_config_has_its_experts(moe_files):
    """The expert count, top-k and expert rows come from the `expert_*` keys (transformers
    leaves the rows at Qwen3MoeConfig's default, 768); every layer is sparse and the top-k
    weights renormalised, as llama.cpp's qwen3moe runs them."""
    from minisgl.config import ModelConfig

    folder = _served(moe_files("Q4_K"))
    cfg = ModelConfig.from_dir(folder)
    assert cfg.architecture == "Qwen3MoeForCausalLM"
    assert cfg.moe is not None
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (4, 2, 512)
    assert cfg.moe.norm_topk_prob and cfg.moe.sparse_layers == (0, 1)
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (64, 4, 2)
    manifest = json.loads((folder / "packed" / "manifest.json").read_text())
    assert manifest["native"] == "int4"  # the experts hold most of the values


@pytest.mark.card(CARD, MOE_RED)
@pytest.mark.card(CARD, MOE_ITEM)
@pytest.mark.parametrize("kind", list(MOE_CLASS))
def test_a_qwen3_moe_file_serves_its_dequantized_values_at_fp32(kind, moe_files):
    """fp32 logits equal transformers' own load of the file (its stacked experts, split into
    gate and up by its tensor processor) within 1e-5; greedy decoding of a batch gives its
    tokens."""
    path = moe_files(kind)
    _served(path)
    llm = _llm(path, "none")
    assert llm.engine.quantization == "none"
    torch.testing.assert_close(prompt_logits(llm, IDS), _reference_logits(path),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    prompts = random_prompts(3, 4, 20, vocab=380, seed=5)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [o["token_ids"] for o in got] == hf_greedy(_reference(path), prompts, 8)


@pytest.mark.card(CARD, MOE_RED)
@pytest.mark.card(CARD, MOE_ITEM)
@pytest.mark.parametrize("kind", list(MOE_CLASS))
def test_auto_serves_a_qwen3_moe_file_in_its_class(kind, moe_files):
    """`quantization="auto"`: the file's class, the experts packed in it (`QuantizedExperts`),
    the router float; logits within the class's error of the de-quantized reference."""
    from minisgl.quantization.experts import QuantizedExperts

    path = moe_files(kind)
    _served(path)
    llm = _llm(path, "auto")
    assert llm.engine.quantization == MOE_CLASS[kind]
    packed = [m for m in llm.engine.model.modules() if isinstance(m, QuantizedExperts)]
    assert len(packed) == 2
    err = _relative_error(prompt_logits(llm, IDS), _reference_logits(path))
    assert err <= MOE_PACKED_ERROR[kind], f"{kind}: relative logits error {err:.4f}"


# Mixtral files: llama.cpp stores Mixtral as `llama` with `llama.expert_count` and the same
# stacked experts; transformers' GGUF support does not read them, so the reference is the HF
# Mixtral the tiny file was written from (an F32 file holds its values exactly)
MIXTRAL_ITEM = "a-mixtral-file-serves-as-mixtral"
MIXTRAL_RED = "failing-tests-a-mixtral-file"


@pytest.mark.card(CARD, MIXTRAL_RED)
@pytest.mark.card(CARD, MIXTRAL_ITEM)
def test_a_mixtral_file_serves_the_hf_mixtral_it_holds(tmp_path):
    """An F32 Mixtral file: a MixtralForCausalLM config (experts, top-k, expert rows from
    `feed_forward_length`, no sliding window: a GGUF file has none), fp32 logits within 1e-5
    of the HF model it was written from, and its greedy tokens in a batch."""
    from transformers import AutoModelForCausalLM

    from minisgl.config import ModelConfig

    path = write_tiny_gguf("mixtral", tmp_path / "mixtral.gguf", "F32")
    cfg = ModelConfig.from_dir(_served(path))
    assert cfg.architecture == "MixtralForCausalLM"
    assert cfg.moe is not None
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (4, 2, 512)
    assert cfg.moe.sparse_layers == (0, 1)
    hf = str(path) + ".hf"
    got = prompt_logits(_llm(path, "none"), IDS)
    assert _relative_error(got, _hf_logits(hf)) <= 1e-5
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    prompts = random_prompts(3, 4, 20, vocab=380, seed=5)
    out = _llm(path, "none").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    assert [o["token_ids"] for o in out] == hf_greedy(ref, prompts, 8)


@pytest.mark.card(CARD, MIXTRAL_RED)
@pytest.mark.card(CARD, MIXTRAL_ITEM)
def test_auto_serves_a_q4_k_mixtral_file_as_int4(tmp_path):
    """A Q4_K Mixtral file: `auto` serves int4 with packed experts, within the class's error of
    the file's de-quantized values served at fp32."""
    from minisgl.quantization.experts import QuantizedExperts

    path = write_tiny_gguf("mixtral", tmp_path / "mixtral-q4k.gguf", "Q4_K")
    _served(path)
    want = prompt_logits(_llm(path, "none"), IDS)
    llm = _llm(path, "auto")
    assert llm.engine.quantization == "int4"
    assert sum(isinstance(m, QuantizedExperts) for m in llm.engine.model.modules()) == 2
    err = _relative_error(prompt_logits(llm, IDS), want)
    assert err <= MOE_PACKED_ERROR["Q4_K"], f"relative logits error {err:.4f}"


@pytest.mark.parametrize("family, tied", [("qwen2", True), ("llama", False)])
def test_a_converted_folder_names_its_embedding_as_hf_saves_it(family, tied, tmp_path):
    """A file's folder is an HF folder other engines load: the embedding is stored as
    `model.embed_tokens.weight` (what transformers' `save_pretrained` writes and vLLM reads;
    vLLM 0.32 left the embedding at zero when it found only `lm_head.weight`, and decoded token
    0 for every prompt); a tied one is `lm_head.weight` too (same values: what earlier minisgl
    versions read, sharing the cache), an untied file's output matrix its own."""
    from safetensors.torch import load_file

    folder = _served(write_tiny_gguf(family, tmp_path / f"{family}.gguf"))
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is tied
    weights = load_file(str(folder / "model.safetensors"))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    assert torch.equal(embed, head) is tied


@pytest.mark.parametrize("kept", ["lm_head.weight", "model.embed_tokens.weight"])
def test_a_folder_with_one_tied_name_gets_the_other_on_its_next_use(kept, tmp_path):
    """Folders converted before held a tied embedding as `lm_head.weight` alone (and for a day
    as `model.embed_tokens.weight` alone): the next use adds the other name in place (same
    values; the packed cache beside it stays)."""
    from safetensors.torch import load_file, save_file

    path = write_tiny_gguf("qwen2", tmp_path / "t.gguf")
    folder = _served(path)
    weights = load_file(str(folder / "model.safetensors"))
    embedding = weights.pop("model.embed_tokens.weight")
    weights.pop("lm_head.weight")
    weights[kept] = embedding
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    packed = sorted(p.name for p in (folder / "packed").iterdir())

    assert _served(path) == folder
    now = load_file(str(folder / "model.safetensors"))
    assert set(now) == set(weights) | {"model.embed_tokens.weight", "lm_head.weight"}
    assert torch.equal(now["model.embed_tokens.weight"], embedding)
    assert torch.equal(now["lm_head.weight"], embedding)
    assert sorted(p.name for p in (folder / "packed").iterdir()) == packed
