"""The C prefill attention kernel (card P2-003): a CPU prefill step's short requests attend in
place over the KV pool, checked against SDPA per request and, through the engine, HF."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl import LLM, SamplingParams
from minisgl.kernels import cpu as cpu_native
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.scenarios import assert_kv_clean, cpu_attention, random_prompts
from minisgl.testing.tiny_models import write_tiny_model

PREFILL = "prefill-attention-of-short-requests-through-the-kernel-matches-sdpa-and-hf"
GAP = 2  # q rows between two requests that no request names (the kernel must not write them)


pytestmark = pytest.mark.isa_paths


def prefill_case(q_lens, prefixes, kvh, gqa, d, dtype, seed):
    """Requests of q_lens[r] new tokens after prefixes[r] cached ones; their KV at scattered
    pool rows, their q rows GAP apart. Returns q [T, KVH, gqa, D], the pools, the indices and
    the (q_starts, q_lens, kv_starts, kv_lens) tensors."""
    g = torch.Generator().manual_seed(seed)
    q_lens = torch.tensor(q_lens)
    kv_lens = q_lens + torch.tensor(prefixes)
    q_starts = torch.cumsum(q_lens + GAP, 0) - q_lens - GAP
    kv_starts = torch.cumsum(kv_lens, 0) - kv_lens
    n_kv = int(kv_lens.sum())
    rows = 3 * n_kv + 5
    k_pool = torch.randn(rows, kvh, d, generator=g).to(dtype)
    v_pool = torch.randn(rows, kvh, d, generator=g).to(dtype)
    indices = torch.randperm(rows, generator=g)[:n_kv]
    q = torch.randn(int(q_starts[-1] + q_lens[-1]) + GAP, kvh, gqa, d, generator=g).to(dtype)
    return q, k_pool, v_pool, indices, (q_starts, q_lens, kv_starts, kv_lens)


def reference(q, k_pool, v_pool, indices, spans, window, dtype=torch.float32):
    """SDPA per request (in `dtype`) with the causal rule after the prefix as a mask; rows that
    no request names are NaN."""
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    kvh, gqa, d = q.shape[1:]
    for q0, n, kv0, length in zip(*(s.tolist() for s in spans)):
        rows = indices[kv0 : kv0 + length]
        qs = q[q0 : q0 + n].to(dtype).reshape(n, kvh * gqa, d).transpose(0, 1)
        ks = k_pool[rows].to(dtype).repeat_interleave(gqa, dim=1).transpose(0, 1)
        vs = v_pool[rows].to(dtype).repeat_interleave(gqa, dim=1).transpose(0, 1)
        pos = torch.arange(length - n, length)[:, None]
        key = torch.arange(length)[None, :]
        mask = key <= pos
        if window > 0:
            mask &= key > pos - window
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        out[q0 : q0 + n] = o.transpose(0, 1).reshape(n, kvh, gqa, d)
    return out


@pytest.mark.card("P2-003", PREFILL)
@pytest.mark.parametrize(
    "q_lens,prefixes,kvh,gqa,d,window",
    [([5, 17, 1, 33], [0, 0, 3, 40], 3, 3, 64, 0),
     ([70, 2], [300, 0], 2, 4, 128, 0),  # two tiles of keys, five blocks of tokens
     ([9, 30], [20, 0], 2, 3, 40, 12),  # a head_dim that is no multiple of 16, a window
     ([1, 64], [0, 129], 1, 16, 16, 0),  # 16 query heads a KV head: 4 tokens a block
     ([40], [200], 4, 1, 256, 50),  # the window across tiles
     ([3, 8], [0, 0], 2, 2, 32, 0)],
)  # fmt: skip
def test_prefill_kernel_matches_sdpa_fp32(q_lens, prefixes, kvh, gqa, d, window):
    q, kp, vp, idx, spans = prefill_case(q_lens, prefixes, kvh, gqa, d, torch.float32, seed=d)
    sentinel = torch.full_like(q, 7.0)
    out = cpu_native.prefill_attention(q, kp, vp, idx, *spans, window, out=sentinel)
    assert out.data_ptr() == sentinel.data_ptr()
    ref = reference(q, kp, vp, idx, spans, window)
    named = ~ref.isnan()
    torch.testing.assert_close(out[named], ref[named], rtol=1e-5, atol=2e-6)
    assert bool((out[~named] == 7.0).all()) and int((~named).sum()) == GAP * len(q_lens) * (
        kvh * gqa * d
    )


@pytest.mark.card("P2-003", PREFILL)
@pytest.mark.parametrize("d,window", [(64, 0), (64, 20), (40, 0)])
def test_prefill_kernel_bf16_is_as_close_as_sdpa(d, window):
    """bf16: as accurate against fp32 as SDPA in bf16 (the unnormalised probabilities are
    rounded to bf16, as in the flash kernel)."""
    q, kp, vp, idx, spans = prefill_case([12, 50, 3], [0, 30, 90], 3, 3, d, torch.bfloat16, 3)
    out = cpu_native.prefill_attention(q, kp, vp, idx, *spans, window)
    assert out.dtype == torch.bfloat16
    ref = reference(q, kp, vp, idx, spans, window)
    sdpa = reference(q, kp, vp, idx, spans, window, dtype=torch.bfloat16)
    named = ~ref.isnan()
    ours = (out.float() - ref)[named].abs().mean()
    theirs = (sdpa.float() - ref)[named].abs().mean()
    assert ours <= 1.1 * theirs, (ours, theirs)


@pytest.mark.card("P2-003", PREFILL)
def test_prefill_kernel_rejects_spans_outside_q_the_indices_and_the_pool():
    q, kp, vp, idx, spans = prefill_case([4, 6], [0, 5], 2, 2, 64, torch.float32, seed=1)
    q_starts, q_lens, kv_starts, kv_lens = spans

    def call(**change):
        s = dict(q_starts=q_starts, q_lens=q_lens, kv_starts=kv_starts, kv_lens=kv_lens)
        s.update(change)
        cpu_native.prefill_attention(q, kp, vp, change.get("indices", idx), s["q_starts"],
                                     s["q_lens"], s["kv_starts"], s["kv_lens"], 0)  # fmt: skip

    bad = idx.clone()
    bad[7] = kp.shape[0]
    with pytest.raises(ValueError, match="outside the pool"):
        call(indices=bad)
    with pytest.raises(ValueError, match="query rows outside q"):
        call(q_starts=q_starts + q.shape[0] - 8)
    with pytest.raises(ValueError, match="KV range outside the indices"):
        call(kv_starts=kv_starts + 3)
    with pytest.raises(ValueError, match="length"):
        call(q_lens=q_lens + torch.tensor([1, 0]))  # more new tokens than keys
    with pytest.raises(ValueError, match="one start and length"):
        call(kv_lens=kv_lens[:1])


def record_prefill_routes(backend) -> list[tuple[int, int, int]]:
    """The backend's prefill steps from now on, each as (kernel requests, SDPA-alone requests,
    padded groups)."""
    steps: list[tuple[int, int, int]] = []
    prepare = backend.prepare

    def recording(plan, *args, **kwargs):
        meta = prepare(plan, *args, **kwargs)
        if meta.is_prefill:
            steps.append((0 if meta.kernel is None else len(meta.kernel.q_lens),
                          len(meta.requests), len(meta.groups)))  # fmt: skip
        return meta

    backend.prepare = recording
    return steps


@pytest.mark.card("P2-003", "failing-tests-prefill-attention-through-the-kernel")
@pytest.mark.card("P2-003", PREFILL)
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])  # mistral: sliding window
def test_prefill_through_the_kernel_matches_hf(arch, tmp_path):
    """fp32 greedy through the kernel (every prefill request shorter than
    PREFILL_ALONE_MIN_TOKENS: fresh prompts, prefix hits, chunks) is HF's text and SDPA's."""
    path = write_tiny_model(arch, tmp_path / arch, seed=0)
    system = random_prompts(1, 40, 40, seed=5)[0]
    prompts = [system + p for p in random_prompts(5, 5, 50, seed=6)] + random_prompts(3, 90, 120)
    outs, rows = {}, {}
    for mode in ("native", "sdpa"):
        with cpu_attention(mode):
            llm = LLM(path, num_pages=4096, max_extend_tokens=48)  # long prompts in chunks
        got = llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))
        got += llm.generate(prompts[1:], SamplingParams(max_tokens=12, ignore_eos=True))
        outs[mode] = [o["token_ids"] for o in got]
        backend = llm.engine.backend
        # rows the kernel attended (none where the backend has no kernel path)
        rows[mode] = (getattr(backend, "prefill_kernel_rows", 0), backend.prefill_alone_rows)
        assert_kv_clean(llm)
    # 48-token chunks: every prefill row is short; prompts[1:5] hit the 40-token system prompt
    assert rows["native"] == (sum(len(p) for p in prompts) - 4 * 40, 0)
    assert rows["sdpa"] == (0, 0)
    ref = hf_greedy(load_hf_model(path), prompts, 12)
    assert outs["native"] == [ref[0][:4], *ref[1:]]
    assert outs["native"] == outs["sdpa"]


@pytest.mark.card("P2-003", PREFILL)
def test_one_step_mixes_the_kernel_sdpa_per_request_and_the_padded_call(tmp_path):
    """One prefill step with a short prompt (the kernel), a long one (SDPA alone) and a short
    suffix after a 300-token cached prefix (past PREFILL_KERNEL_MAX_KV: the padded call): each
    writes its own rows of the step's output; fp32 greedy is HF's."""
    from minisgl.attention.torch_native import PREFILL_ALONE_MIN_TOKENS, PREFILL_KERNEL_MAX_KV

    path = write_tiny_model("llama", tmp_path / "m", seed=0)
    system = random_prompts(1, 300, 300, seed=7)[0]
    prompts = [system + random_prompts(1, 10, 10, seed=8)[0], *random_prompts(1, 20, 20, seed=9),
               *random_prompts(1, 100, 100, seed=10)]  # fmt: skip
    assert PREFILL_KERNEL_MAX_KV < 300 and 20 < PREFILL_ALONE_MIN_TOKENS <= 100
    llm = LLM(path, num_pages=4096)
    backend = llm.engine.backend
    assert backend.native
    llm.generate([system], SamplingParams(max_tokens=1, ignore_eos=True))
    kernel0, alone0 = backend.prefill_kernel_rows, backend.prefill_alone_rows
    steps = record_prefill_routes(backend)
    out = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert steps == [(1, 1, 1)]
    assert backend.prefill_kernel_rows - kernel0 == 20
    assert backend.prefill_alone_rows - alone0 == 100
    ref = hf_greedy(load_hf_model(path), prompts, 8)
    assert [o["token_ids"] for o in out] == ref
    assert_kv_clean(llm)


AMX = "a-bf16-prefill-step-attends-every-request-in-one-amx-kernel-call"
RED_AMX = "failing-tests-prefill-attention-on-amx-tiles"


def amx_here(dtype: torch.dtype, head_dim: int) -> bool:
    fn = getattr(cpu_native, "prefill_amx", None)
    assert fn is not None, "cpu_native.prefill_amx is missing"
    return fn(dtype, head_dim)


def cpu_has_amx() -> bool:
    """AMX-BF16 as the code paths see it: the CPU's, under MINISGL_CPU_ISA's cap."""
    from minisgl.utils.cpu import cpu_flags

    return "amx_bf16" in cpu_flags()


@pytest.mark.card("P2-003", RED_AMX)
@pytest.mark.card("P2-003", AMX)
@pytest.mark.parametrize(
    "q_lens,prefixes,kvh,gqa,d,window",
    [([5, 17, 1, 33], [0, 0, 3, 40], 3, 3, 64, 0),
     ([70, 2], [300, 0], 2, 4, 128, 0),  # more than 256 keys, tokens in five blocks of 16
     ([200, 150, 100], [0, 1000, 33], 3, 3, 64, 0),  # long prompts and a long prefix
     ([9, 30], [20, 0], 2, 3, 64, 12),  # a window
     ([40], [200], 4, 1, 256, 50),  # the widest head, the window across key blocks
     ([1, 64], [0, 129], 1, 16, 32, 0)],  # 16 query heads a KV head
)  # fmt: skip
def test_amx_prefill_is_as_close_as_sdpa(q_lens, prefixes, kvh, gqa, d, window, monkeypatch):
    """bf16 on AMX tiles where the CPU has them: every request of the step in one call, as
    accurate against fp32 as SDPA in bf16 and as the vector kernel (MINISGL_CPU_AMX=0); rows
    that no request names keep their values."""
    assert amx_here(torch.bfloat16, d) == cpu_has_amx()
    q, kp, vp, idx, spans = prefill_case(q_lens, prefixes, kvh, gqa, d, torch.bfloat16, seed=d)
    ref = reference(q, kp, vp, idx, spans, window)
    named = ~ref.isnan()
    sdpa = (reference(q, kp, vp, idx, spans, window, dtype=torch.bfloat16).float() - ref)[named]
    errors = {}
    for amx in ("1", "0"):
        monkeypatch.setenv("MINISGL_CPU_AMX", amx)
        sentinel = torch.full_like(q, 7.0)
        out = cpu_native.prefill_attention(q, kp, vp, idx, *spans, window, out=sentinel)
        assert bool((out[~named] == 7.0).all())
        errors[amx] = (out.float() - ref)[named].abs()
    for err in errors.values():
        assert float(err.mean()) <= 1.1 * float(sdpa.abs().mean())
        assert float(err.max()) <= 2.0 * float(sdpa.abs().max())


@pytest.mark.card("P2-003", RED_AMX)
@pytest.mark.card("P2-003", AMX)
def test_amx_prefill_takes_bf16_with_head_dims_of_32(monkeypatch):
    assert amx_here(torch.bfloat16, 64) == amx_here(torch.bfloat16, 256) == cpu_has_amx()
    assert not amx_here(torch.float32, 64)  # fp32 (HF parity) keeps the vector kernel
    assert not amx_here(torch.bfloat16, 40) and not amx_here(torch.bfloat16, 288)
    monkeypatch.setenv("MINISGL_CPU_AMX", "0")
    assert not amx_here(torch.bfloat16, 64)


@pytest.mark.card("P2-003", RED_AMX)
@pytest.mark.card("P2-003", AMX)
def test_bf16_prefill_attends_every_request_in_one_kernel_call(tmp_path):
    """A bf16 engine (head_dim 32) on an AMX CPU: long prompts, prefix hits and chunks all
    attend through the kernel, none through SDPA; the step's logits are SDPA's (bf16)."""
    from minisgl.config import EngineConfig
    from minisgl.engine.engine import Engine
    from minisgl.testing.plans import PlannedBatch

    path = write_tiny_model("llama", tmp_path / "m", seed=2, head_dim=32)
    lens = [70, 130, 9, 200, 40]
    logits, rows = {}, {}
    for mode in ("native", "sdpa"):
        with cpu_attention(mode):
            engine = Engine(EngineConfig(model_path=str(path), dtype="bfloat16", num_pages=2048,
                                         max_seq_len_override=256))  # fmt: skip
        batch = PlannedBatch.for_engine(engine, lens, per_request=256, seed=3)
        logits[mode] = engine.forward(batch.plan(True))
        backend = engine.backend
        rows[mode] = (getattr(backend, "prefill_kernel_rows", 0), backend.prefill_alone_rows)
    long = sum(n for n in lens if n >= 64)
    if cpu_has_amx():
        assert rows["native"] == (sum(lens), 0)
    else:
        assert rows["native"] == (sum(lens) - long, long)
    assert rows["sdpa"] == (0, long)
    ours, theirs = logits["native"], logits["sdpa"]
    torch.testing.assert_close(ours, theirs, atol=0.05 * float(theirs.abs().max()), rtol=0.0)
    assert int((ours.argmax(-1) == theirs.argmax(-1)).sum()) >= 4

    system = random_prompts(1, 300, 300, seed=11)[0]
    prompts = [system + p for p in random_prompts(3, 5, 90, seed=12)] + random_prompts(2, 90, 150)
    llm = LLM(path, dtype="bfloat16", num_pages=4096, max_extend_tokens=128)  # chunks
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    out = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)
    assert [len(o["token_ids"]) for o in out] == [6] * len(prompts)
    backend = llm.engine.backend
    if cpu_has_amx():  # prompts[1:3] hit the 300-token system prompt
        assert getattr(backend, "prefill_kernel_rows", 0) == sum(map(len, prompts)) - 2 * 300
        assert backend.prefill_alone_rows == 0
    assert_kv_clean(llm)


@pytest.mark.card("P2-003", AMX)
@pytest.mark.parametrize("seed", range(12))
def test_amx_prefill_random_steps(seed):
    """Random steps (1-6 requests, 1-80 new tokens after 0-300 cached ones, head_dim 32-128,
    1-8 query heads a KV head, windows): the kernel's rows against fp32 SDPA per request,
    within the error SDPA itself makes in bf16."""
    g = torch.Generator().manual_seed(seed)

    def pick(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    n = pick(1, 6)
    q_lens = [pick(1, 80) for _ in range(n)]
    prefixes = [pick(0, 300) * pick(0, 1) for _ in range(n)]
    d, gqa, kvh = [32, 64, 128][pick(0, 2)], [1, 2, 3, 8][pick(0, 3)], pick(1, 3)
    window = [0, 0, pick(1, 100)][pick(0, 2)]
    q, kp, vp, idx, spans = prefill_case(q_lens, prefixes, kvh, gqa, d, torch.bfloat16, seed)
    out = cpu_native.prefill_attention(q, kp, vp, idx, *spans, window)
    ref = reference(q, kp, vp, idx, spans, window)
    named = ~ref.isnan()
    sdpa = (reference(q, kp, vp, idx, spans, window, dtype=torch.bfloat16).float() - ref)[named]
    err = (out.float() - ref)[named].abs()
    assert float(err.mean()) <= 1.1 * float(sdpa.abs().mean()) + 1e-6
    assert float(err.max()) <= 2.0 * float(sdpa.abs().max()) + 1e-6


@pytest.mark.card("P2-003", PREFILL)
def test_store_rows_writes_the_pool_as_index_put():
    """A prefill step's K / V rows into the pool through C row copies: the pool index_put_
    leaves (strided rows of a fused projection's output too), bad locations rejected before
    anything is written, other layouts through index_put_."""
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(50, 3, 8, generator=g).bfloat16()
    fused = torch.randn(6, 40, generator=g).bfloat16()
    rows = fused[:, 16:].view(6, 3, 8)  # row stride 40: a view of the fused output
    loc = torch.tensor([7, 0, 49, 12, 13, 30])
    want = pool.clone()
    want[loc] = rows
    cpu_native.store_rows(pool, loc, rows)
    assert torch.equal(pool, want)
    before = pool.clone()
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_native.store_rows(pool, torch.tensor([1, 2, 3, 4, 5, 50]), rows)
    assert torch.equal(pool, before)
    odd = torch.randn(6, 8, 3, generator=g).bfloat16().transpose(1, 2)  # [6, 3, 8], D strided
    cpu_native.store_rows(pool, loc, odd)
    assert torch.equal(pool[loc], odd)
