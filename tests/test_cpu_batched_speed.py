"""Batched CPU decode (card P2-003): the C decode attention kernel against SDPA and HF, and the
batched speed gates of issue 12 (`worklog/gates/P2-003.yaml`)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minisgl import LLM, SamplingParams
from minisgl.kernels import cpu as cpu_native
from minisgl.testing.cpu_speed import run_cpu_speed
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.scenarios import assert_kv_clean, cpu_attention, random_prompts
from minisgl.testing.tiny_models import write_tiny_model

KERNEL = "native-decode-attention-matches-sdpa-over-gqa-windows-and-strided-kv"
HEADROOM = "a-batch-over-the-workspace-budget-with-full-headroom-keeps-the-workspace-with-less"


def reference(q, k, v, lens, window):
    """SDPA in fp32 with the kernel's visibility rule as a boolean mask."""
    pos = torch.arange(k.shape[2])[None, :]
    valid = pos < lens[:, None]
    if window > 0:
        valid &= pos >= lens[:, None] - window
    qf, kf, vf = q.float(), k.float(), v.float()
    return F.scaled_dot_product_attention(qf, kf, vf, attn_mask=valid[:, None, None, :])


def case(bs, kvh, gqa, d, cap, dtype, seed, layout="workspace"):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, cap + 1, (bs,), generator=g)
    lens[0] = cap
    q = torch.randn(bs, kvh, gqa, d, generator=g).to(dtype)
    if layout == "workspace":  # [bs, KVH, capacity, D] blocks read up to the longest length
        k = torch.randn(bs, kvh, cap + 7, d, generator=g).to(dtype)[:, :, :cap]
        v = torch.randn(bs, kvh, cap + 7, d, generator=g).to(dtype)[:, :, :cap]
    else:  # a gather from the pool: [bs, L, KVH, D] seen as [bs, KVH, L, D]
        k = torch.randn(bs, cap, kvh, d, generator=g).to(dtype).transpose(1, 2)
        v = torch.randn(bs, cap, kvh, d, generator=g).to(dtype).transpose(1, 2)
    return q, k, v, lens


@pytest.mark.card("P2-003", KERNEL)
@pytest.mark.parametrize("layout", ["workspace", "gather"])
@pytest.mark.parametrize(
    "bs,kvh,gqa,d,cap,window",
    [(1, 1, 1, 64, 1, 0), (16, 3, 3, 64, 265, 0), (5, 2, 4, 128, 70, 0), (7, 4, 1, 32, 90, 16),
     (64, 3, 3, 64, 40, 0), (3, 2, 8, 64, 300, 128), (6, 2, 3, 40, 45, 0), (9, 2, 5, 16, 37, 0),
     (4, 1, 3, 256, 23, 0)],
)  # fmt: skip
def test_kernel_matches_sdpa_fp32(bs, kvh, gqa, d, cap, window, layout):
    q, k, v, lens = case(bs, kvh, gqa, d, cap, torch.float32, seed=bs * 31 + cap, layout=layout)
    out = cpu_native.decode_attention(q, k, v, lens, window)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, reference(q, k, v, lens, window), rtol=1e-5, atol=2e-6)


@pytest.mark.card("P2-003", KERNEL)
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("d", [64, 40])  # 512-bit vectors where the CPU has them; portable
def test_kernel_matches_sdpa_bf16(window, d):
    """bf16: as accurate as SDPA's flash kernel against fp32 (it rounds the unnormalised
    probabilities to bf16 as flash does), so a bf16 model decodes the same text either way."""
    q, k, v, lens = case(16, 3, 3, d, 200, torch.bfloat16, seed=7)
    out = cpu_native.decode_attention(q, k, v, lens, window)
    assert out.dtype == torch.bfloat16
    ref = reference(q, k, v, lens, window)
    pos = torch.arange(200)[None, :]
    valid = (pos < lens[:, None]) & ((pos >= lens[:, None] - window) | (window == 0))
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
    ours, theirs = (out.float() - ref).abs().mean(), (sdpa.float() - ref).abs().mean()
    assert ours <= 1.1 * theirs, (ours, theirs)
    torch.testing.assert_close(out.float(), sdpa.float(), rtol=2e-2, atol=8e-3)


def paged_case(bs, kvh, gqa, d, cap, dtype, seed):
    """A pool of rows [N, KVH, D] and each request's rows scattered through it, as the KV pool
    holds them; the same K / V as a dense [bs, KVH, cap, D] view for the reference."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, cap + 1, (bs,), generator=g)
    lens[0] = cap
    rows = 4 * bs * cap + 11
    k_pool = torch.randn(rows, kvh, d, generator=g).to(dtype)
    v_pool = torch.randn(rows, kvh, d, generator=g).to(dtype)
    # each request owns cap rows (a few spare past its length, as a prefix-cache page would)
    perm = torch.randperm(rows, generator=g)[: bs * cap].view(bs, cap)
    indptr = torch.arange(bs + 1) * cap
    q = torch.randn(bs, kvh, gqa, d, generator=g).to(dtype)
    dense = (k_pool[perm].transpose(1, 2), v_pool[perm].transpose(1, 2))  # [bs, KVH, cap, D]
    return q, k_pool, v_pool, perm.reshape(-1), indptr, lens, dense


@pytest.mark.card("P2-003", KERNEL)
@pytest.mark.parametrize(
    "bs,kvh,gqa,d,cap,window,dtype",
    [(16, 3, 3, 64, 120, 0, torch.float32), (5, 2, 4, 128, 70, 24, torch.float32),
     (6, 2, 3, 40, 45, 0, torch.float32), (9, 3, 3, 64, 50, 0, torch.bfloat16),
     (3, 1, 5, 16, 33, 8, torch.bfloat16)],
)  # fmt: skip
def test_paged_kernel_reads_the_pool_in_place(bs, kvh, gqa, d, cap, window, dtype):
    """The paged kernel over a pool and row indices gives what the dense kernel gives over the
    same K / V gathered (bit for bit: the same sums in the same order), and matches SDPA."""
    q, kp, vp, indices, indptr, lens, (k, v) = paged_case(bs, kvh, gqa, d, cap, dtype, seed=d)
    out = cpu_native.paged_decode_attention(q, kp, vp, indices, indptr, lens, window)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.equal(out, cpu_native.decode_attention(q, k, v, lens, window))
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), reference(q, k, v, lens, window), **tol)


@pytest.mark.card("P2-003", KERNEL)
def test_paged_kernel_rejects_rows_outside_the_pool_and_lengths_outside_indptr():
    q, kp, vp, indices, indptr, lens, _ = paged_case(4, 2, 2, 64, 20, torch.float32, seed=5)
    bad = indices.clone()
    bad[3] = kp.shape[0]  # one past the pool
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_native.paged_decode_attention(q, kp, vp, bad, indptr, lens, 0)
    longer = lens.clone()
    longer[1] = 21  # more keys than its indptr range holds
    with pytest.raises(ValueError, match="outside 1..L"):
        cpu_native.paged_decode_attention(q, kp, vp, indices, indptr, longer, 0)
    with pytest.raises(ValueError, match="indptr outside"):
        cpu_native.paged_decode_attention(q, kp, vp, indices[:30], indptr, lens, 0)


@pytest.mark.card("P2-003", KERNEL)
def test_kernel_under_torch_compile():
    q, k, v, lens = case(4, 2, 2, 64, 50, torch.float32, seed=3)
    fn = torch.compile(lambda *a: cpu_native.decode_attention(*a, 0) * 2.0, dynamic=True)
    with torch.no_grad():
        torch.testing.assert_close(fn(q, k, v, lens) / 2.0, reference(q, k, v, lens, 0))


@pytest.mark.card("P2-003", KERNEL)
@pytest.mark.parametrize("bad", [0, 51])
def test_kernel_rejects_lengths_outside_the_kv(bad):
    q, k, v, lens = case(4, 2, 2, 64, 50, torch.float32, seed=4)
    lens[2] = bad
    with pytest.raises(ValueError, match="length"):
        cpu_native.decode_attention(q, k, v, lens, 0)


@pytest.mark.card("P2-003", KERNEL)
def test_loading_the_kernel_keeps_denormals():
    """Built with -ffast-math, the library must not set flush-to-zero for the process (it would
    if linked with -ffast-math: crtfastmath), or every fp32 op in torch would change."""
    code = (
        "import torch; from minisgl.kernels import cpu as c; "
        "assert c.available(torch.float32); "
        "x = torch.tensor([1e-39]); print(float((x * 0.5)[0]) > 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"


@pytest.mark.card("P2-003", "decode-through-the-kernel-is-token-identical-to-hf-in-fp32")
@pytest.mark.card("P2-003", "decode-attention-on-a-cpu-runs-through-the-kernel")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_decode_through_the_kernel_matches_hf_and_sdpa(arch, tmp_path):
    path = write_tiny_model(arch, tmp_path / arch, seed=0)
    prompts = random_prompts(6, 5, 60, seed=11)
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(6)]
    outs = {}
    for mode in ("native", "sdpa"):
        with cpu_attention(mode):
            llm = LLM(path, num_pages=4096)
        backend = llm.engine.backend
        assert backend.native == (mode == "native")
        outs[mode] = [o["token_ids"] for o in llm.generate(prompts, params)]
        assert_kv_clean(llm)
        # the kernel reads the pool in place: no dense workspace, no rebuild as the batch
        # shrinks (requests finish at six different steps); SDPA rebuilds on each change
        ws = backend.workspace
        if mode == "native":
            assert ws.k is None and ws.rebuilds == ws.appends == 0
        else:
            assert ws.rebuilds >= 6 and ws.appends > 0
    ref = hf_greedy(load_hf_model(path), prompts, 6 + 3 * 5)
    assert outs["native"] == [r[: 6 + 3 * i] for i, r in enumerate(ref)]
    assert outs["native"] == outs["sdpa"]


@pytest.mark.card("P2-003", "a-machine-without-a-c-compiler-decodes-through-sdpa")
@pytest.mark.card("P2-003", "sdpa-remains-the-fallback-and-the-reference")
def test_no_compiler_falls_back_to_sdpa(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("MINISGL_KERNEL_CACHE", str(tmp_path / "cache"))
    cpu_native._library.cache_clear()
    try:
        assert not cpu_native.available(torch.float32)
        path = write_tiny_model("llama", tmp_path / "m", seed=0)
        llm = LLM(path, num_pages=1024)
        assert not llm.engine.backend.native
        out = llm.generate(random_prompts(2, 5, 20, seed=2), SamplingParams(max_tokens=4))
        assert [len(o["token_ids"]) for o in out] == [4, 4]
    finally:
        cpu_native._library.cache_clear()


@pytest.mark.card("P2-003", "failing-tests-workspace-headroom-under-the-budget")
@pytest.mark.card("P2-003", HEADROOM)
def test_a_batch_that_fits_with_less_headroom_keeps_the_workspace(monkeypatch):
    """Headroom shrinks to what the budget holds (a rebuild comes sooner) before the batch is
    dropped to the gather path; only a batch without 16 positions of headroom is."""
    from minisgl.attention.decode_workspace import DecodeWorkspace

    min_grow = 16  # decode_workspace.MIN_GROW

    per_position = 2 * 4 * 8 * 2 * 16 * 4  # K and V x layers x batch x KV heads x D x fp32
    lens = np.full(8, 100, dtype=np.int32)
    monkeypatch.setenv("MINISGL_DECODE_WORKSPACE_MB", "1")  # 1 MiB: 128 positions
    ws = DecodeWorkspace(4, 2, 16, torch.float32, torch.device("cpu"))
    assert (1 << 20) // per_position == 128
    assert ws.mode(np.arange(8), lens) == "rebuild"
    assert ws.k[0].shape == (8, 2, 128, 16)  # 28 positions of headroom, not 128
    for step in range(1, 29):
        assert ws.mode(np.arange(8), lens + step) == "append"
    assert ws.mode(np.arange(8), lens + 29) is None  # past the budget: the gather path
    big = np.full(8, 128 - min_grow + 1, dtype=np.int32)
    assert (
        DecodeWorkspace(4, 2, 16, torch.float32, torch.device("cpu")).mode(np.arange(8), big)
        is None
    )


@pytest.mark.card(
    "P2-003", "prefill-attention-per-request-matches-hf-with-prefix-hits-chunks-and-windows"
)
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])  # mistral: sliding window
def test_prefill_per_request_matches_hf_and_the_padded_call(arch, tmp_path, monkeypatch):
    """On a CPU, requests of at least `PREFILL_ALONE_MIN_TOKENS` new tokens attend one by one
    (one SDPA call each, causal with their cached prefix); set to 1 here so every request of
    every prefill step takes that path: fresh prompts, prefix hits and chunked prefill."""
    import minisgl.attention.torch_native as tn

    path = write_tiny_model(arch, tmp_path / arch, seed=0)
    system = random_prompts(1, 40, 40, seed=5)[0]
    prompts = [system + p for p in random_prompts(5, 5, 70, seed=6)] + random_prompts(3, 90, 120)
    outs, rows = {}, {}
    for name, threshold in (("alone", 1), ("padded", 1 << 30)):
        monkeypatch.setattr(tn, "PREFILL_ALONE_MIN_TOKENS", threshold)
        # padded: one SDPA call a step (without the C kernels, which take short requests)
        with cpu_attention("native" if name == "alone" else "sdpa"):
            llm = LLM(path, num_pages=4096, max_extend_tokens=96)  # long prompts in chunks
        got = llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))
        got += llm.generate(prompts[1:], SamplingParams(max_tokens=12, ignore_eos=True))
        outs[name] = [o["token_ids"] for o in got]
        rows[name] = llm.engine.backend.prefill_alone_rows
        assert_kv_clean(llm)
    # prompts[1:5] hit the 40-token system prompt
    assert rows["padded"] == 0 and rows["alone"] == sum(len(p) for p in prompts) - 4 * 40
    ref = hf_greedy(load_hf_model(path), prompts, 12)
    assert outs["alone"] == [ref[0][:4], *ref[1:]]
    assert outs["alone"] == outs["padded"]


@pytest.mark.gate_only
@pytest.mark.bench
@pytest.mark.card("P2-003", "seed-offline-at-least-3x-hf-fp32-and-2x-hf-bf16")
def test_batched_speed_vs_hf(metric, tmp_path):
    """`cpu_speed` on seed-offline: minisgl bf16 with compiled decode beside HF fp32 / bf16
    `generate`, 2 threads, median of 2 repeats, same run (many-short's 3x HF bf16 is P2-004's
    acceptance, with w8a8)."""
    arms = run_cpu_speed(tmp_path, "bf16-compiled", profiles="seed-offline")["seed-offline"]
    mini = arms["minisgl-bf16-compiled"]["output_tok_s"]
    hf32, hf16 = arms["hf-fp32"]["output_tok_s"], arms["hf-bf16"]["output_tok_s"]
    print(f"seed-offline: minisgl bf16 compiled {mini:.1f} tok/s, HF fp32 {hf32:.1f} "
          f"({mini / hf32:.2f}x), HF bf16 {hf16:.1f} ({mini / hf16:.2f}x)")  # fmt: skip
    metric("seed_offline_tok_s_minisgl", mini, unit="tok/s")
    metric("seed_offline_tok_s_hf_fp32", hf32, unit="tok/s")
    metric("seed_offline_tok_s_hf_bf16", hf16, unit="tok/s")


def test_a_compile_error_raises_with_the_compilers_message_and_leaves_no_build(
    tmp_path, monkeypatch
):
    """Every source compiles as its own process; one that fails is compiled again to raise its
    messages, after all of them ended (no compiler left writing into the removed temp folder)."""
    monkeypatch.setenv("MINISGL_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_native, "COMPILE_FLAGS", (*cpu_native.COMPILE_FLAGS, "-fno-such-flag"))
    with pytest.raises(RuntimeError, match="failed:(.|\\n)*no-such-flag"):
        cpu_native.build()
    left = sorted(p.name for p in (tmp_path / "cache" / "kernels").iterdir())
    assert not [n for n in left if not n.endswith(".lock")], left
