"""The fused MoE Triton kernel (`kernels/triton/moe.py`) against the torch experts
(`models/moe.py`): the alignment of pairs to expert blocks, fp32 / bf16 outputs, no host read,
and the fused decoder layer of the tiny MoE models greedy-identical to HF. Without CUDA it runs
in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 set before triton is imported)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from minisgl import LLM, SamplingParams
from minisgl.kernels.triton import fused_moe
from minisgl.kernels.triton.moe import moe_align
from minisgl.models.moe import Experts
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.launches import count_launches
from minisgl.testing.scenarios import assert_kv_clean, random_prompts

CARD = "P2-008"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def experts_of(e: int, h: int, i: int, dtype: torch.dtype, seed: int) -> Experts:
    g = torch.Generator().manual_seed(seed)
    ex = Experts(e, h, i)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(e, 2 * i, h, generator=g) * 0.2)
        ex.down_proj.copy_(torch.randn(e, h, i, generator=g) * 0.2)
    return ex.to(DEVICE, dtype)


def routed(t: int, e: int, k: int, seed: int, skip: int | None = None):
    """x-independent routing: softmax weights of random logits, top-k (expert `skip` never)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    if skip is not None:
        logits[:, skip] = -1e9
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return w.to(DEVICE), ids.to(DEVICE)


@pytest.mark.card(CARD, "the-fused-moe-kernel-matches-the-torch-experts")
@pytest.mark.parametrize("block_m", [16, 64])
def test_align_groups_pairs_by_expert(block_m):
    _, ids = routed(29, 8, 3, seed=1, skip=5)
    pairs, block_expert = moe_align(ids, 8, block_m)
    n = ids.numel()
    assert pairs.numel() % block_m == 0 and block_expert.numel() == pairs.numel() // block_m
    flat = ids.reshape(-1).cpu()
    seen = []
    for b, e in enumerate(block_expert.cpu().tolist()):
        rows = pairs[b * block_m : (b + 1) * block_m].cpu()
        real = rows[rows < n]
        if e < 0:
            assert real.numel() == 0
            continue
        assert (flat[real.long()] == e).all()  # every pair of the block routed to its expert
        seen += real.tolist()
    assert sorted(seen) == list(range(n))  # each pair once
    assert 5 not in block_expert.tolist()  # an expert without tokens has no block


@pytest.mark.card(CARD, "the-fused-moe-kernel-matches-the-torch-experts")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "e", "k", "h", "i"), [(1, 8, 2, 64, 32), (37, 8, 3, 64, 48),
                                                     (70, 4, 2, 96, 64)])  # fmt: skip
def test_fused_moe_matches_the_torch_experts(dtype, t, e, k, h, i):
    """fp32: within a few ulp of the torch experts. bf16: no farther from the fp32 result of the
    same bf16 inputs than the torch experts in bf16 are (the kernel rounds less often: it sums
    the k rows in fp32)."""
    ex = experts_of(e, h, i, dtype, seed=t)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    w, ids = routed(t, e, k, seed=t + 1, skip=e - 1)
    with torch.inference_mode():
        want = ex(x, w.to(dtype), ids)
        with count_launches() as c:
            got = fused_moe(x, ex.gate_up_proj, ex.down_proj, w.to(dtype), ids)
        exact = ex.float()(x.float(), w.to(dtype).float(), ids)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    else:
        err, torch_err = (got.float() - exact).abs().max(), (want.float() - exact).abs().max()
        assert torch_err > 0 and err <= 1.25 * torch_err, (float(err), float(torch_err))
    launches = {n: v for n, v in c.counts.items() if n.startswith("triton:")}
    assert launches == {"triton:_moe_gemm_kernel": 2, "triton:_silu_and_mul_kernel": 1}


@pytest.mark.card(CARD, "the-fused-decoder-layer-of-moe-models-matches-hf")
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fused_layer_greedy_matches_hf(arch, tiny_model_dir, monkeypatch):
    """The fused decoder layer (CUDA path) with its MoE blocks through the kernel: chunked
    prefill, decode and a prefix hit, token-identical to HF in fp32."""
    monkeypatch.setenv("MINISGL_FUSED_OPS", "on")
    path = tiny_model_dir(arch)
    prompts = random_prompts(2, 20, 30, seed=3)
    prompts.append(prompts[0][:16] + random_prompts(1, 4, 6, seed=4)[0])
    ref = hf_greedy(load_hf_model(path), prompts, 4)
    llm = LLM(path, device=DEVICE.type, dtype="float32", attention_backend="triton",
              num_pages=256, max_extend_tokens=24, graph_runner="none", warm_up=False)  # fmt: skip
    assert llm.engine.model.fused_ops is not None
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with count_launches() as c:
        out = llm.generate(prompts[:2], greedy) + llm.generate(prompts[2:], greedy)
    assert [o["token_ids"] for o in out] == ref
    assert c.counts.get("triton:_moe_gemm_kernel", 0) > 0  # the experts ran in the kernel
    assert_kv_clean(llm)
