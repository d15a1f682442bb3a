"""Unfinished requests are cached: a request admitted while an earlier one with the same
prefix is still running reuses the earlier one's prefilled KV (and stays exact vs HF)."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams
from minisgl.scheduler import cpu_backend
from minisgl.scheduler.backend import SchedulerConfig
from minisgl.scheduler.factory import make_scheduler
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.scenarios import assert_kv_clean, random_prompts
from minisgl.testing.tiny_models import write_tiny_model

NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
CHUNK = 48


def _backends() -> list:
    return ["python", pytest.param("rust_hotpath", marks=pytest.mark.rust_ext)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = write_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-sharing"), seed=0)
    return path, load_hf_model(path)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("page_size", [1, 16])
def test_running_request_prefix_is_shared(tiny_llama, backend, page_size, monkeypatch):
    path, hf = tiny_llama
    monkeypatch.setenv("MINISGL_CPU_BACKEND", backend)
    prefix = random_prompts(1, 70, 70, seed=11)[0]
    prompts = [prefix + tail for tail in random_prompts(3, 3, 12, seed=12)]
    ref = hf_greedy(hf, prompts, NEW)
    llm = LLM(path, page_size=page_size, num_pages=4096 // page_size, max_extend_tokens=CHUNK)
    assert llm.scheduler.backend == backend
    sched = llm.scheduler
    # step 1 prefills CHUNK tokens of A (budget spent, nobody else admitted); step 2 finishes
    # A's prompt and admits B, which must hit the CHUNK tokens A cached after step 1
    out = llm.generate(prompts, GREEDY)
    assert [o["token_ids"] for o in out] == ref
    hit = sched.stats.cached_prompt_tokens
    aligned_chunk = CHUNK // page_size * page_size
    aligned_prefix = 70 // page_size * page_size
    assert hit >= aligned_chunk + aligned_prefix, hit  # B hit A's chunk, C the whole prefix
    assert_kv_clean(llm)
    if backend == "rust_hotpath":
        assert cpu_backend.stats()["served"].get("rust_hotpath", {}).get("schedule", 0) > 0


@pytest.mark.parametrize("backend", _backends())
def test_concurrent_duplicates_are_deduplicated(tiny_llama, backend, monkeypatch):
    """Identical prompts prefilled in the same step: the later one's KV pages are swapped for
    the cache's copy when it caches its prefix, so the pool holds the prompt once. (The
    in-batch prefix check keeps them apart by default; off here, as a duplicate can still
    share a step: a prompt shorter than its threshold, or the check at 0.)"""
    path, hf = tiny_llama
    prompt = random_prompts(1, 40, 40, seed=13)[0]
    cfg = SchedulerConfig(num_pages=1024, page_size=1, max_seq_len=256, max_running_requests=8,
                          max_extend_tokens=4096, cache_type="radix",
                          in_batch_prefix_min=0)  # fmt: skip
    sched = make_scheduler(cfg, backend)
    assert sched.backend == backend
    for _ in range(3):
        sched.add_request(prompt, GREEDY)
    plan, reqs = sched.schedule()
    assert plan.is_prefill and len(reqs) == 3
    before = sched.kv_usage()["free_pages"]
    sched.commit(reqs, plan, [1, 1, 1])
    usage = sched.kv_usage()
    assert usage["free_pages"] == before + 2 * 40  # two duplicate prompts' pages came back
    assert usage["cached_tokens"] == 40
    assert [r.cache_len for r in reqs] == [40, 40, 40]
    sched.check_integrity()
    for rid in list(sched.requests):
        sched.abort(rid)
    sched.check_integrity()
    assert sched.kv_usage()["free_pages"] == 1024 - 40  # the prefix stays cached, unlocked
    # the same with the model: three identical prompts in one batch stay exact
    monkeypatch.setenv("MINISGL_CPU_BACKEND", backend)
    ref = hf_greedy(hf, [prompt], NEW)
    llm = LLM(path, page_size=1, num_pages=1024)
    out = llm.generate([prompt] * 3, GREEDY)
    assert [o["token_ids"] for o in out] == ref * 3
    assert_kv_clean(llm)
