"""Card P2-009 (issue 60): the deterministic mode's decode steps run the one-call C decode step,
made batch-invariant (one row through the int4 GEMM's multi-row tiles; every decode step of the
mode there, however many rows), and its prefix cache holds prompts only: a decode step's K / V
differ in the last bits from the prefill path's, so a prompt that extends an earlier answer is
prefilled, as it would be alone on a fresh engine."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.testing.modules import require_module

# again under MINISGL_CPU_ISA=avx512 (noxfile): the mode's no-AMX paths (oneDNN's row blocks
# for prefill, the C step's VNNI GEMM); below AVX512-BF16 the mode is refused (skipped)
pytestmark = pytest.mark.isa_paths

CARD = "P2-009"
RED = "deterministic-decode-tests-fail-before-its-decode-steps-run-in-c"
GREEN = "deterministic-decode-tests-pass"
BACKENDS = ("python", "rust_service")
TARGET = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, logprobs=0)
TINY4 = dict(dtype="bfloat16", quantization="int4", num_pages=32768, max_seq_len_override=512)


def _native_bf16() -> None:
    from minisgl.utils.cpu import native_bf16

    if not native_bf16():
        pytest.skip("deterministic mode needs a CPU with native bf16 (AVX512-BF16 or AMX)")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from minisgl.testing.tiny_models import write_tiny_model

    _native_bf16()
    return write_tiny_model(
        "llama", tmp_path_factory.mktemp("det4-llama"), seed=3, hidden_size=256,
        intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
    )  # fmt: skip


def prompt_of(length: int, seed: int = 11) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, size=length).tolist()


def others(count: int, max_len: int, seed: int = 5) -> tuple[list, list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for k in range(count):
        prompts.append(rng.integers(3, 300, size=int(rng.integers(2, max_len))).tolist())
        params.append(SamplingParams(temperature=(0.0, 0.8)[k % 2], seed=100 + k,
                                     max_tokens=int(rng.integers(1, 32)), ignore_eos=True))  # fmt: skip
    return prompts, params


def drawn(result: dict) -> tuple[list[int], list[float]]:
    return result["token_ids"], [lp.logprob for lp in result["logprobs"]]


def run(model: Path, backend: str, case: str) -> tuple[list[int], list[float]]:
    """The target's tokens and logprobs in `case`, on a fresh deterministic int4 LLM."""
    prompt = prompt_of(160)
    kw = dict(TINY4, max_extend_tokens=24) if case == "chunked" else TINY4
    llm = LLM(model, deterministic=True, cpu_backend=backend, **kw)
    try:
        if case == "prefix":
            llm.generate([[*prompt[:150], 7, 8, 9]], SamplingParams(max_tokens=3, seed=1))
        if case == "batch":  # 79 others: past the C step's 64 rows of the default
            prompts, params = others(79, 200)
            prompts.insert(21, prompt)
            params.insert(21, TARGET)
            return drawn(llm.generate(prompts, params)[21])
        return drawn(llm.generate([prompt], TARGET)[0])
    finally:
        llm.close()


@functools.cache
def alone(model: Path) -> tuple[list[int], list[float]]:
    return run(model, "python", "alone")


# ---------------------------------------------------------------------------- the C step
@pytest.mark.card(CARD, "decode-steps-of-the-mode-run-the-c-decode-step", RED, GREEN)
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_steps_of_the_mode_run_the_c_decode_step(tiny_llama: Path, backend: str) -> None:
    llm = LLM(tiny_llama, deterministic=True, cpu_backend=backend, **TINY4)
    try:
        step = llm.engine.cpu_decode
        assert step is not None, "the mode decodes through the torch modules"
        out = llm.generate([prompt_of(40)] * 3, SamplingParams(max_tokens=8, ignore_eos=True))
        assert [len(o["token_ids"]) for o in out] == [8, 8, 8]
        assert step.steps >= 7, step.steps  # every decode step of the request
    finally:
        llm.close()


@pytest.mark.card(
    CARD, "the-invariant-int4-gemm-gives-a-row-its-bits-at-every-row-count-one-row-included",
    RED, GREEN,
)  # fmt: skip
@pytest.mark.parametrize(("n", "k"), [(64, 64), (200, 576), (67, 160), (1536, 576)])
def test_the_invariant_int4_gemm_gives_one_row_its_bits_among_many(n: int, k: int) -> None:
    int4 = require_module("minisgl.kernels.cpu.int4")
    from minisgl.quantization.packed import quantize_int4

    g = torch.Generator().manual_seed(n + k)
    w4 = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
    sz = torch.stack((w4.scale.t(), w4.zero.t()), dim=-1).bfloat16()
    w = int4.Int4Matrix.of(w4.q, sz, torch.randn(n, generator=g).bfloat16())
    x = (torch.randn(20, k, generator=g) * 3).bfloat16()
    try:
        full = int4.int4_gemv(x, w, invariant=True)
    except TypeError as exc:
        raise AssertionError(f"int4_gemv has no batch-invariant mode: {exc}") from None
    for i in range(len(x)):
        assert torch.equal(int4.int4_gemv(x[i : i + 1], w, invariant=True), full[i : i + 1]), i
    for start, rows in [(0, 2), (3, 5), (1, 8), (2, 13)]:
        got = int4.int4_gemv(x[start : start + rows], w, invariant=True)
        assert torch.equal(got, full[start : start + rows]), (start, rows)
    # the same numbers as the default's multi-row path: only one row changes kernel
    assert torch.equal(int4.int4_gemv(x, w), full)


# ---------------------------------------------------------------------------- the cache
@pytest.mark.card(CARD, "the-mode-s-prefix-cache-holds-prompts-only", RED, GREEN)
def test_the_mode_s_prefix_cache_holds_prompts_only() -> None:
    from minisgl.scheduler.backend import SchedulerConfig
    from minisgl.scheduler.factory import make_scheduler

    def cached_after(cache_outputs: bool) -> int:
        try:
            cfg = SchedulerConfig(num_pages=256, page_size=4, max_seq_len=128,
                                  max_running_requests=4, max_extend_tokens=256,
                                  cache_outputs=cache_outputs)  # fmt: skip
        except TypeError as exc:
            raise AssertionError(f"SchedulerConfig has no cache_outputs: {exc}") from None
        sched = make_scheduler(cfg, "python")
        sched.add_request(list(range(3, 25)), SamplingParams(max_tokens=10, ignore_eos=True))
        while sched.requests:
            plan, reqs = sched.schedule()
            sched.commit(reqs, plan, [40 + i for i in range(len(plan.sample_rows))])
        sched.check_integrity()
        return sched.kv_usage()["cached_tokens"]

    assert cached_after(True) == 28  # 22 prompt + 9 fed outputs = 31 computed, 7 pages of 4
    assert cached_after(False) == 20  # the prompt's 5 full pages


@pytest.mark.card(
    CARD, "a-prefix-hit-on-an-earlier-answer-keeps-the-tokens-of-a-fresh-engine", GREEN
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefix_hit_on_an_earlier_answer_keeps_the_tokens(tiny_llama: Path, backend: str):
    """A chat's second turn: its prompt is the first turn's prompt and answer, then more. On
    the engine that served the first turn it gets the tokens it gets alone on a fresh one."""
    first = prompt_of(90, seed=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    fresh = LLM(tiny_llama, deterministic=True, cpu_backend="python", **TINY4)
    try:
        answer = fresh.generate([first], greedy)[0]["token_ids"]
    finally:
        fresh.close()
    second = [*first, *answer, *prompt_of(12, seed=4)]
    want = None
    for warm in (False, True):
        llm = LLM(tiny_llama, deterministic=True, cpu_backend=backend, **TINY4)
        try:
            if warm:
                assert llm.generate([first], greedy)[0]["token_ids"] == answer
            got = drawn(llm.generate([second], TARGET)[0])
        finally:
            llm.close()
        if want is None:
            want = got
    assert len(want[0]) == 24
    assert got == want


@pytest.mark.card(
    CARD, "an-int4-model-keeps-its-tokens-batched-chunked-and-cached-on-both-control-planes",
    GREEN,
)  # fmt: skip
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["batch", "chunked", "prefix"])
def test_an_int4_model_keeps_its_tokens(tiny_llama: Path, backend: str, case: str) -> None:
    want = alone(tiny_llama)
    assert len(want[0]) == 24
    got = run(tiny_llama, backend, case)
    assert got[0] == want[0], f"{case} on {backend}: tokens differ from the request alone"
    assert got[1] == want[1], f"{case} on {backend}: logprobs differ from the request alone"
