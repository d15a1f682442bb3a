"""No Triton kernel compiles while serving (issue 36): a launch whose arguments Triton keys
differently from every earlier launch (a pointer's 16-byte alignment, an int that is 1 or a
multiple of 16 or neither) compiles a new variant of the kernel on the spot: on the H200 the
nano-vllm profile stalled ~1 s in two of its nine prefill steps (214 and 865 ms where the
others took 12-40 ms). The step's inputs are views of one staged buffer at offsets that depend
on the step's sizes, so their alignment changed from step to step. Here: every staged segment
starts 16-byte aligned, and after the runtime's warm-up a workload of other sizes (chunked
prefill, prefix hits, batches of 1-5 requests, sampled rows, eager decode) launches no variant
the warm-up did not. Run on a CPU in Triton's interpreter, keyed as the compiler keys them
(`testing/launches.py`: `record_variants`)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

from minisgl import LLM, SamplingParams
from minisgl.step.plan import PLAN_FIELDS, StepPlan
from minisgl.step.staging import PlanStager
from minisgl.testing.launches import KernelVariant, record_variants, variant_key
from minisgl.testing.scenarios import assert_kv_clean, random_prompts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CARD = "P2-001"
RED = "kernel-variant-tests-fail-before-the-change"
GREEN = "kernel-variant-tests-pass"


def plan_of_sizes(bs: int, tokens: int, kv: int, sampled: int, seed: int) -> StepPlan:
    rng = np.random.default_rng(seed)
    sizes = {"slots": bs, "extend_lens": bs, "seq_lens": bs, "kv_indptr": bs + 1,
             "input_ids": tokens, "positions": tokens, "out_loc": tokens, "kv_indices": kv,
             "logits_indices": sampled, "sample_rows": sampled}  # fmt: skip
    fields = {f: rng.integers(0, 1000, sizes[f], dtype=np.int32) for f in PLAN_FIELDS}
    return StepPlan(True, **fields)


@pytest.mark.card(CARD, "staged-step-inputs-start-16-byte-aligned", RED, GREEN)
def test_every_staged_segment_starts_16_byte_aligned():
    stager = PlanStager(torch.device(DEVICE), capacity=64)
    rng = np.random.default_rng(0)
    for i in range(60):
        bs = int(rng.integers(1, 9))
        plan = plan_of_sizes(bs, int(rng.integers(bs, 40)), int(rng.integers(bs, 90)),
                             int(rng.integers(1, bs + 1)), seed=i)  # fmt: skip
        staged = stager.stage(plan)
        for f in PLAN_FIELDS:
            seg = getattr(staged, f)
            assert seg.data_ptr() % 16 == 0, (f, plan.batch_size, plan.num_tokens)
            assert np.array_equal(seg.cpu().numpy(), getattr(plan, f)), f


@pytest.mark.card(CARD, "kernel-variants-keyed-as-triton-s-jit-keys-them")
def test_the_key_follows_tritons_rules():
    """A pointer keys on its 16-byte alignment, an int on being 1 / a multiple of 16 / neither;
    a `do_not_specialize` int on its type only; constexprs on their values."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(X, n, m, B: tl.constexpr):
        pass

    @triton.jit(do_not_specialize=["n"])
    def k2(X, n, m, B: tl.constexpr):
        pass

    x = torch.zeros(64, dtype=torch.int32)

    def key(kernel, *args, **kw):
        return variant_key(kernel, args, {"B": 4, **kw})

    # the same class of every argument: one key (an offset of 16 bytes keeps the alignment)
    assert key(k, x[4:], 17, 3) == key(k, x, 5, 7)
    assert key(k, x, 32, 16) == key(k, x[8:], 48, 64)
    # another class of one argument: another key
    assert key(k, x[1:], 5, 7) != key(k, x, 5, 7)  # a pointer 4 bytes off
    assert len({key(k, x, n, 7) for n in (1, 16, 17)}) == 3  # 1 / multiple of 16 / other
    assert key(k, x, 5, 7, B=8) != key(k, x, 5, 7)  # a constexpr's value
    assert key(k, x, 5, 7, num_warps=8) != key(k, x, 5, 7)  # a launch option
    assert dict(key(k, x, 5, 7))["B"] == "constexpr=4"
    # `do_not_specialize`: every value of the int one key, the other arguments as before
    assert len({key(k2, x, n, 7) for n in (1, 16, 17)}) == 1
    assert key(k2, x, 1, 16) != key(k2, x, 1, 17)
    with record_variants() as rec:
        k[(1,)](x, 1, 32, B=4)
        k[(1,)](x[4:], 2, 33, B=4)
        k[(1,)](x[1:], 2, 33, B=4)
    assert rec.launches == 3 and len(rec.variants) == 3
    assert all(isinstance(v, KernelVariant) and v.kernel == "k" for v in rec.variants)


@pytest.mark.card(CARD, "no-triton-kernel-variant-compiles-after-the-warm-up")
def test_the_fused_ops_compile_one_variant_for_every_row_count():
    """A step's row count (1, a multiple of 16, any other) is a grid size or an unspecialised
    argument, never a new variant: the sampler's argmax outside the graphs runs at the step's
    number of sampled rows."""
    from minisgl.kernels.triton import add_rms_norm_, argmax_rows, rms_norm, silu_and_mul

    gen = torch.Generator().manual_seed(0)
    with record_variants() as rec:
        for rows in (1, 16, 17, 32, 5):
            x = torch.randn(rows, 64, generator=gen).to(DEVICE)
            w = torch.randn(64, generator=gen).to(DEVICE)
            rms_norm(x, w, 1e-6)
            add_rms_norm_(x, x.clone(), w, 1e-6)
            silu_and_mul(torch.randn(rows, 128, generator=gen).to(DEVICE))
            argmax_rows(torch.randn(rows, 1000, generator=gen).to(DEVICE))
    by_kernel: dict[str, int] = {}
    for v in rec.variants:
        by_kernel[v.kernel] = by_kernel.get(v.kernel, 0) + 1
    assert rec.launches == 5 * 5
    assert by_kernel == {"_rms_norm_kernel": 2, "_silu_and_mul_kernel": 1,
                         "_argmax_blocks_kernel": 1, "_argmax_merge_kernel": 1}, rec.describe(
        rec.variants
    )  # fmt: skip


@pytest.mark.card(CARD, "no-triton-kernel-variant-compiles-after-the-warm-up", RED, GREEN)
def test_no_kernel_compiles_after_the_warm_up(tiny_model_dir, monkeypatch):
    """The fused ops and the triton attention (Mistral: its sliding window too; the other
    architectures launch the same kernels with other constexprs), decode eager (no graphs: a
    batch above `--cuda-graph-max-bs` runs so on a GPU)."""
    monkeypatch.setenv("MINISGL_FUSED_OPS", "on")
    llm = LLM(tiny_model_dir("mistral"), device=DEVICE, dtype="float32", attention_backend="triton",
              num_pages=1024, max_extend_tokens=24, max_running_requests=8,
              graph_runner="none")  # fmt: skip
    with record_variants() as warm:
        llm.runtime.warm_up()
    prompts = random_prompts(10, 3, 33, seed=11)
    prompts.append(prompts[3][:20] + random_prompts(1, 5, 9, seed=12)[0])  # a prefix hit
    greedy = [SamplingParams(temperature=0.0, max_tokens=2 + n % 4, ignore_eos=True)
              for n in range(11)]  # fmt: skip
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=5, ignore_eos=True, seed=1)
    with record_variants() as served:
        for lo, hi in ((0, 1), (1, 4), (4, 9), (9, 11)):
            llm.generate(prompts[lo:hi], greedy[lo:hi])
        llm.generate(prompts[:2], [greedy[0], sampled])
    assert served.launches > 0
    new = served.variants - warm.variants
    assert not new, f"{len(new)} kernel variants compiled after the warm-up:\n" + warm.describe(new)
    assert_kv_clean(llm)
