"""Greedy decoding is token-identical to HF transformers (fp32, CPU) on every architecture."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.scenarios import assert_kv_clean, random_prompts

NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_cache():
    cache: dict = {}

    def get(path):
        if path not in cache:
            cache[path] = load_hf_model(path)
        return cache[path]

    return get


def make_llm(path, **kw) -> LLM:
    kw.setdefault("num_pages", 4096 // kw.get("page_size", 1))
    return LLM(path, **kw)


@pytest.mark.card(
    "P0-010",
    "llama-qwen2-qwen3-and-mistral-match-hf-greedy-decoding",
    "continuous-batching-of-mixed-prompt-lengths",
    "greedy-decoding-token-identical-to-hf-at-page-size-1-and-16",
    "kv-pages-all-free-or-cached-after-every-scenario",
)
@pytest.mark.parametrize("page_size", [1, 16])
def test_single_and_mixed_batch(arch, page_size, tiny_model_dir, hf_cache):
    path = tiny_model_dir(arch)
    prompts = random_prompts(5, 2, 70, seed=1)
    ref = hf_greedy(hf_cache(path), prompts, NEW)
    llm = make_llm(path, page_size=page_size)
    single = llm.generate([prompts[0]], GREEDY)
    assert single[0]["token_ids"] == ref[0]
    assert single[0]["finish_reason"] == "length"
    batch = llm.generate(prompts, GREEDY)  # one continuous batch, mixed lengths
    assert [o["token_ids"] for o in batch] == ref
    assert_kv_clean(llm)


@pytest.mark.card(
    "P0-010",
    "chunked-prefill-of-long-prompts",
    "greedy-decoding-token-identical-to-hf-at-page-size-1-and-16",
    "kv-pages-all-free-or-cached-after-every-scenario",
)
@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill(arch, page_size, tiny_model_dir, hf_cache):
    path = tiny_model_dir(arch)
    prompts = random_prompts(3, 90, 130, seed=2)
    ref = hf_greedy(hf_cache(path), prompts, NEW)
    llm = make_llm(path, page_size=page_size, max_extend_tokens=24, cache_type="naive")
    out = llm.generate(prompts, GREEDY)
    assert llm.scheduler.stats.steps > NEW + 130 // 24  # the prompts really went in chunks
    assert [o["token_ids"] for o in out] == ref
    assert_kv_clean(llm)


@pytest.mark.card(
    "P0-010",
    "shared-prefixes-hit-the-cache-and-stay-exact",
    "greedy-decoding-token-identical-to-hf-at-page-size-1-and-16",
    "kv-pages-all-free-or-cached-after-every-scenario",
)
@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_hits_radix_cache(arch, page_size, tiny_model_dir, hf_cache):
    path = tiny_model_dir(arch)
    prefix = random_prompts(1, 70, 70, seed=3)[0]
    prompts = [prefix + tail for tail in random_prompts(3, 3, 20, seed=4)]
    ref = hf_greedy(hf_cache(path), prompts, NEW)
    llm = make_llm(path, page_size=page_size)
    first = llm.generate(prompts[:1], GREEDY)
    assert llm.scheduler.stats.cached_prompt_tokens == 0
    rest = llm.generate(prompts[1:], GREEDY)
    hit = llm.scheduler.stats.cached_prompt_tokens
    assert hit >= 2 * (70 // page_size * page_size) - 2 * page_size  # both reused the prefix
    assert [o["token_ids"] for o in first + rest] == ref
    again = llm.generate(prompts, GREEDY)  # full-prompt hits, batched
    assert [o["token_ids"] for o in again] == ref
    assert_kv_clean(llm)


@pytest.mark.card("P0-010", "tight-memory-evicts-the-cache-and-stays-exact")
def test_tight_memory_evicts_and_stays_exact(tiny_model_dir, hf_cache):
    path = tiny_model_dir("llama")
    prompts = random_prompts(8, 30, 60, seed=5)
    ref = hf_greedy(hf_cache(path), prompts, NEW)
    llm = LLM(path, num_pages=160, page_size=1)  # fits ~2 requests at a time
    out = llm.generate(prompts, GREEDY)
    assert [o["token_ids"] for o in out] == ref
    assert_kv_clean(llm)
