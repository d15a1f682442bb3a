"""CUDA checks run by `nox -s gpu` (self-hosted GPU runners, or any CUDA machine).

Marked `gpu`: without a CUDA device the cardgate plugin skips them as missing evidence, so the
CPU suite reports them as skipped and `nox -s gpu` refuses to start (it needs the device).
"""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.scenarios import assert_kv_clean, random_prompts
from minisgl.testing.tiny_models import write_tiny_model

pytestmark = pytest.mark.gpu

NEW = 12


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp32_greedy_on_cuda_matches_hf_on_cuda(arch, page_size, tmp_path):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both sides
    path = write_tiny_model(arch, tmp_path / arch, seed=0)
    prompts = random_prompts(5, 2, 70, seed=1)
    ref = hf_greedy(load_hf_model(path, device="cuda"), prompts, NEW)
    llm = LLM(str(path), device="cuda", dtype="float32", page_size=page_size, num_pages=4096)
    assert llm.engine.device.type == "cuda"
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o["token_ids"] for o in out] == ref
    assert_kv_clean(llm)
