"""Greedy generation is token-identical with the `rust_hotpath` CPU backend: the parity and
API scenarios of the core tests, re-run with `MINISGL_CPU_BACKEND=rust_hotpath`."""

from __future__ import annotations

import pytest
from test_llm_api import (  # noqa: F401
    test_abort_frees_everything,
    test_seeded_sampling_is_reproducible,
    test_stop_string_truncates_text,
    test_stop_token_ids_and_max_tokens,
    test_top_k_one_is_greedy,
)
from test_parity_hf import (  # noqa: F401
    hf_cache,
    test_chunked_prefill,
    test_shared_prefix_hits_radix_cache,
    test_single_and_mixed_batch,
    test_tight_memory_evicts_and_stays_exact,
)

from minisgl import LLM
from minisgl.scheduler import cpu_backend
from minisgl.testing.rust_hotpath import RustScheduler

# every test collected here (the imported P0-010 scenarios) is evidence for P0-004 as well
pytestmark = [
    pytest.mark.card(
        "P0-004", "greedy-generation-and-the-offline-api-scenarios-exact-with-the-rust-backend"
    ),
    pytest.mark.rust_ext,
]


@pytest.fixture(autouse=True)
def _rust_backend(monkeypatch):
    monkeypatch.setenv("MINISGL_CPU_BACKEND", "rust_hotpath")
    before = cpu_backend.stats()["served"].get("rust_hotpath", {}).get("schedule", 0)
    yield
    after = cpu_backend.stats()["served"].get("rust_hotpath", {}).get("schedule", 0)
    assert after > before, "the rust backend served no step"


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINISGL_CPU_BACKEND", "rust_hotpath")
        llm = LLM(tiny_model_dir("llama"), num_pages=2048, max_seq_len_override=256)
    assert isinstance(llm.scheduler, RustScheduler)
    return llm
