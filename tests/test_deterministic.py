"""Issue 60, "a deterministic mode": `LLM(deterministic=True)` (the server's `--deterministic`)
gives a seeded request the same tokens, and the same logprobs, whatever else is batched,
chunked or cached beside it, on both CPU control planes (python and the Rust service).

Each case compares one seeded request (temperature 0.8, seed 7, 24 tokens) with the same
request served alone on a fresh engine: (a) alone, (b) among 63 other requests of other
lengths and parameters, (c) under chunked prefill (a small `max_extend_tokens`), (d) after a
prefix hit (the prompt's first tokens cached by another request). The logprobs of the drawn
tokens are compared too: they are the logits' bits, so a batch-variant kernel shows there even
where no draw flips. Without the mode none of this is promised (and it is not asserted)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from minisgl import LLM, SamplingParams

BACKENDS = ("python", "rust_service")
TARGET = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, logprobs=0)
TINY = dict(dtype="bfloat16", num_pages=32768, max_seq_len_override=512)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from minisgl.testing.tiny_models import write_tiny_model

    # the default tiny llama, wider: a 1024-feature MLP and 8 heads of 32
    return write_tiny_model(
        "llama", tmp_path_factory.mktemp("det-llama"), seed=3, hidden_size=256,
        intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
    )  # fmt: skip


def target_prompt(length: int = 160) -> list[int]:
    return np.random.default_rng(11).integers(3, 300, size=length).tolist()


def others(count: int, max_len: int, seed: int = 5) -> tuple[list, list[SamplingParams]]:
    """`count` requests of other lengths and sampling parameters."""
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for k in range(count):
        prompts.append(rng.integers(3, 300, size=int(rng.integers(2, max_len))).tolist())
        kind = k % 4
        params.append(
            SamplingParams(
                temperature=(0.0, 0.8, 1.0, 0.5)[kind],
                top_k=(-1, -1, 20, -1)[kind],
                top_p=(1.0, 1.0, 1.0, 0.9)[kind],
                seed=None if kind == 2 else 100 + k,
                max_tokens=int(rng.integers(1, 32)),
                ignore_eos=True,
            )
        )
    return prompts, params


def drawn(result: dict) -> tuple[list[int], list[float]]:
    return result["token_ids"], [lp.logprob for lp in result["logprobs"]]


def run(model: Path | None, backend: str, case: str, **kw) -> tuple[list[int], list[float]]:
    """The target request's tokens and logprobs in `case`, on a fresh deterministic LLM."""
    prompt = target_prompt()
    if case == "chunked":
        kw["max_extend_tokens"] = 24
    llm = LLM(model, deterministic=True, cpu_backend=backend, **kw)
    try:
        if case == "prefix":  # another request caches the prompt's first 150 tokens
            llm.generate([[*prompt[:150], 7, 8, 9]], SamplingParams(max_tokens=3, seed=1))
        if case == "batch":
            prompts, params = others(63, 200)
            prompts.insert(21, prompt)
            params.insert(21, TARGET)
            return drawn(llm.generate(prompts, params)[21])
        return drawn(llm.generate([prompt], TARGET)[0])
    finally:
        llm.close()


@functools.cache
def tiny_alone(model: Path) -> tuple[list[int], list[float]]:
    return run(model, "python", "alone", **TINY)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["alone", "batch", "chunked", "prefix"])
def test_tiny_llama_bf16_same_tokens_whatever_runs_beside(
    tiny_llama: Path, backend: str, case: str
) -> None:
    want = tiny_alone(tiny_llama)
    assert len(want[0]) == 24
    got = run(tiny_llama, backend, case, **TINY)
    assert got[0] == want[0], f"{case} on {backend}: tokens differ from the request alone"
    assert got[1] == want[1], f"{case} on {backend}: logprobs differ from the request alone"


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_llama_greedy_n4_choices_identical_and_equal_n1(tiny_llama: Path, backend: str):
    """Greedy, n=4: the four choices equal the n=1 answer, alone on a fresh engine and among
    12 other requests after the n=1 request cached the prompt."""
    prompt = target_prompt(90)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    greedy4 = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=4)
    llm = LLM(tiny_llama, deterministic=True, cpu_backend=backend, **TINY)
    try:
        alone4 = llm.generate([prompt], greedy4)[0]["outputs"]
        one = llm.generate([prompt], greedy)[0]["token_ids"]
        prompts, params = others(12, 120, seed=9)
        batch4 = llm.generate([*prompts, prompt], [*params, greedy4])[-1]["outputs"]
    finally:
        llm.close()
    assert len(one) == 24
    assert [o["token_ids"] for o in alone4] == [one] * 4
    assert [o["token_ids"] for o in batch4] == [one] * 4


def test_embedded_model_same_tokens_batched_chunked_and_cached() -> None:
    """The embedded model (int4 weights, bf16 here): the target alone on the python control
    plane, then on the Rust service among 63 others, its prefix cached, prefill chunked."""
    emb = dict(max_seq_len_override=512, num_pages=20000)
    want = run(None, "python", "alone", **emb)
    prompt = target_prompt()
    llm = LLM(deterministic=True, cpu_backend="rust_service", max_extend_tokens=96, **emb)
    try:
        llm.generate([[*prompt[:150], 7, 8, 9]], SamplingParams(max_tokens=3, seed=1))
        prompts, params = others(63, 120)
        prompts.insert(40, prompt)
        params.insert(40, TARGET)
        got = drawn(llm.generate(prompts, params)[40])
    finally:
        llm.close()
    assert len(want[0]) == 24
    assert got[0] == want[0]
    assert got[1] == want[1]


def test_deterministic_refuses_what_it_cannot_make_batch_invariant(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="deterministic"):
        LLM(tiny_llama, deterministic=True, dtype="float32", num_pages=256)
    with pytest.raises(ValueError, match="deterministic"):
        LLM(tiny_llama, deterministic=True, dtype="bfloat16", enable_torch_compile=True,
            num_pages=256)  # fmt: skip


def test_server_flag_reaches_the_engine_config() -> None:
    from minisgl.server.args import parse_args

    assert parse_args(["--deterministic"]).llm_kwargs()["deterministic"] is True
    assert parse_args([]).llm_kwargs()["deterministic"] is False


@pytest.mark.parametrize("window", [0, 48, 200])
def test_prefill_kernel_query_rows_do_not_depend_on_the_chunking(window: int) -> None:
    """The vector C prefill kernel (every attention of deterministic mode): a query's output is
    the same bits whether its prompt is one request of 300 tokens, chunks after a cached prefix,
    or one query at a time (decode), with a sliding window too (tiles anchored at multiples
    of the tile size, not at the block's first key)."""
    import torch

    from minisgl.kernels import cpu as cpu_native

    if not cpu_native.available(torch.bfloat16):
        pytest.skip("no C kernels")
    g = torch.Generator().manual_seed(0)
    n, kvh, gqa, d = 300, 2, 4, 64
    k_pool = torch.randn(n + 3, kvh, d, generator=g).bfloat16()
    v_pool = torch.randn(n + 3, kvh, d, generator=g).bfloat16()
    idx = torch.randperm(n + 3, generator=g)[:n]
    q = torch.randn(n, kvh, gqa, d, generator=g).bfloat16()

    def attend(chunks: list[tuple[int, int]]) -> torch.Tensor:
        """Chunks (start, end) of the prompt as requests of one call, each after its prefix."""
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        return cpu_native.prefill_attention(
            q, k_pool, v_pool, idx, t([a for a, _ in chunks]), t([b - a for a, b in chunks]),
            t([0] * len(chunks)), t([b for _, b in chunks]), window, amx=False,
        )  # fmt: skip

    whole = attend([(0, n)])
    assert torch.equal(attend([(0, 37), (37, 170), (170, 300)]), whole)
    assert torch.equal(attend([(0, 5), (5, 290), *((i, i + 1) for i in range(290, 300))]), whole)


@pytest.mark.parametrize("shape", [(576, 3072), (576, 49152)])
def test_linear_row_bits_do_not_depend_on_the_row_count(shape: tuple[int, int]) -> None:
    """A linear made batch-invariant gives a row the same bits at every row count and offset:
    one row (oneDNN's one-row kernel differs), 2..32 rows, and more (oneDNN's AMX kernel, from
    33 rows where the CPU has AMX, rounds differently: the rows go in blocks of at most 32)."""
    import torch

    from minisgl.engine.deterministic import make_batch_invariant
    from minisgl.utils.cpu import native_bf16

    if not native_bf16():
        pytest.skip("deterministic mode needs a CPU with native bf16")
    torch.manual_seed(0)
    lin = torch.nn.Linear(*shape, bias=False).bfloat16()
    assert make_batch_invariant(lin) == 1
    x = torch.randn(300, shape[0], dtype=torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
        for start, rows in [(0, 2), (3, 17), (0, 32), (1, 33), (0, 64), (5, 95), (0, 100),
                            (0, 256), (1, 257), (0, 300)]:  # fmt: skip
            assert torch.equal(lin(x[start : start + rows]), alone[start : start + rows]), rows


def _fake_gemm(w, wide_kernel_from: int | None = None, per_count: bool = False):
    """A linear's forward for `row_block`: each row's sums in float64, rounded to bf16 (its
    bits its own); from `wide_kernel_from` rows on, another kernel's bits (as oneDNN's AMX tiles
    from 33 rows: here the sums plus 1/8); `per_count`: every row count its own bits."""

    def forward(x):
        y = (x.double() @ w.double().t()).bfloat16()
        if wide_kernel_from is not None and x.shape[0] >= wide_kernel_from:
            return y + 2.0**-3
        return y + x.shape[0] * 2.0**-4 if per_count else y

    return forward


def test_a_linear_runs_in_the_widest_row_block_whose_rows_agree() -> None:
    """Deterministic mode's row blocks are as wide as the GEMM allows, probed per layer at load:
    a GEMM whose rows agree at every probed count (2..256, two offsets) runs blocks of 256 (one
    GEMM where oneDNN had 8: 1.4-1.8x on the embedded model's shapes, amd-epyc); one whose kernel
    changes from 33 rows runs blocks of 32, as before; one whose every row count differs is
    refused (the mode cannot keep its promise there). A one-row block still runs as two rows."""
    import torch

    from minisgl.engine.deterministic import ROW_BLOCK, WIDE_ROW_BLOCK, RowBlocks, row_block

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g).bfloat16()
    assert (ROW_BLOCK, WIDE_ROW_BLOCK) == (32, 256)
    assert row_block(_fake_gemm(w), 64, torch.bfloat16) == WIDE_ROW_BLOCK
    assert row_block(_fake_gemm(w, wide_kernel_from=33), 64, torch.bfloat16) == ROW_BLOCK
    assert row_block(_fake_gemm(w, wide_kernel_from=200), 64, torch.bfloat16) == ROW_BLOCK
    with pytest.raises(ValueError, match="deterministic mode: .*row count"):
        row_block(_fake_gemm(w, per_count=True), 64, torch.bfloat16)
    calls: list[int] = []

    def counted(x):
        calls.append(x.shape[0])
        return _fake_gemm(w)(x)

    blocks = RowBlocks(counted, WIDE_ROW_BLOCK)
    x = torch.randn(513, 64, generator=g).bfloat16()
    assert torch.equal(blocks(x), _fake_gemm(w)(x))
    assert calls == [256, 256, 2]  # the last row alone, as two rows
    calls.clear()
    RowBlocks(counted, ROW_BLOCK)(x[:70])
    assert calls == [32, 32, 6]


@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (576, 1040)])
def test_int4_rows_do_not_depend_on_the_row_count(shape: tuple[int, int]) -> None:
    """An int4 layer made batch-invariant (the AMX GEMM where the CPU has AMX-BF16, else
    oneDNN in row blocks, on its weights de-quantized once): a row gets the same bits alone,
    in a short tile or a full one, at any offset; an empty call is an empty result; the sums
    are the de-quantized weights'. 1040 features: the last 32 columns of a tile pair are 16."""
    import torch

    from minisgl.engine.deterministic import make_batch_invariant
    from minisgl.quantization.linear import Int4Linear
    from minisgl.quantization.packed import quantize_int4
    from minisgl.utils.cpu import native_bf16

    if not native_bf16():
        pytest.skip("deterministic mode needs a CPU with native bf16")
    torch.manual_seed(0)
    k, n = shape
    layer = Int4Linear(quantize_int4(torch.randn(n, k) * 0.05), None, torch.bfloat16)
    w = layer.dequantize().float()
    assert make_batch_invariant(layer) == 1
    x = torch.randn(70, k, dtype=torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
        for start, rows in [(0, 2), (3, 3), (0, 16), (1, 17), (0, 33), (5, 65), (0, 70)]:
            assert torch.equal(layer(x[start : start + rows]), alone[start : start + rows]), rows
        assert layer(x[:0]).shape == (0, n)  # a step none of whose rows wants logits
    ref = x.float() @ w.t()
    assert torch.allclose(alone.float(), ref, rtol=0.02, atol=0.01 * float(ref.abs().max()))


@pytest.mark.parametrize("n", [16, 40, 1040])
def test_amx_gemm_rows_are_their_own_and_match_fp32(n: int) -> None:
    """The AMX GEMM (`kernels/cpu/amx_gemm.c`), where the CPU has AMX-BF16: with a bias, any
    row count (1, a short tile of 16, two, 32 + a tail) gives each row the bits it gets alone,
    within bf16 rounding of the fp32 product; columns not a multiple of 16 or 32."""
    import torch
    import torch.nn.functional as F

    from minisgl.kernels.cpu import amx_gemm

    if not amx_gemm.supported():
        pytest.skip("no AMX-BF16 here (or the C kernels did not build)")
    g = torch.Generator().manual_seed(1)
    k = 96
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    weight = amx_gemm.AmxWeight.of(w, bias)
    x = torch.randn(50, k, generator=g).bfloat16()
    alone = torch.cat([amx_gemm.amx_gemm(x[i : i + 1], weight) for i in range(len(x))])
    for start, rows in [(0, 1), (2, 15), (0, 16), (3, 17), (0, 32), (1, 49)]:
        assert torch.equal(amx_gemm.amx_gemm(x[start : start + rows], weight),
                           alone[start : start + rows]), rows  # fmt: skip
    ref = F.linear(x.float(), w.float(), bias.float())
    assert torch.allclose(alone.float(), ref, rtol=0.01, atol=0.01)
    with pytest.raises(ValueError, match="amx_gemm"):
        amx_gemm.amx_gemm(x[:, :64], weight)


def test_a_linear_on_the_amx_gemm_keeps_one_copy_of_its_weights() -> None:
    """Where the AMX GEMM takes a float linear, its packed copy is the layer's only copy: the
    nn.Linear's own bf16 weight is released (a bf16 model in deterministic mode held every
    linear twice); a weight another module shares (a tied lm_head) stays with that module.
    Elsewhere (oneDNN in row blocks) the layer keeps its weight and runs on it."""
    import torch

    from minisgl.engine.deterministic import make_batch_invariant
    from minisgl.kernels.cpu import amx_gemm
    from minisgl.utils.cpu import native_bf16

    if not native_bf16():
        pytest.skip("deterministic mode needs a CPU with native bf16")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64)).bfloat16()
    tied = torch.nn.Embedding(64, 96).bfloat16()
    model[1].weight = tied.weight  # [64, 96]: shared, as a tied lm_head's
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = model(x)
        assert make_batch_invariant(model) == 2
        got = model(x)
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    on_amx = amx_gemm.supported()
    kept = [m.weight.numel() for m in model]
    assert kept == ([0, 0] if on_amx else [64 * 96, 96 * 64]), kept
    assert tied.weight.shape == (64, 96)
