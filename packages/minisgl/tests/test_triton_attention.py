"""The triton attention backend against torch-native and a plain PyTorch reference.

Without CUDA the kernels run in Triton's interpreter on CPU tensors: TRITON_INTERPRET=1 has to
be set before triton is first imported (triton.jit reads it when it decorates a function), so
this module sets it at import. With CUDA the same checks run compiled on the GPU, and the
`gpu`-marked tests add realistic sizes.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

from minisgl import LLM, SamplingParams
from minisgl.attention import (
    _OPTIONAL,
    available_backends,
    create_backend,
    resolve_backend,
    unavailable_reason,
)
from minisgl.attention.torch_native import TorchNativeBackend
from minisgl.attention.triton_backend import TritonBackend
from minisgl.attention.triton_kernels import INTERPRETED
from minisgl.attention.triton_kernels.decode import DecodeBuffers, decode_attention
from minisgl.attention.triton_kernels.extend import extend_attention, extend_blocks
from minisgl.attention.triton_kernels.kv_store import store_kv
from minisgl.kvcache.pool import KVPool
from minisgl.step.plan import build_step_plan
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.scenarios import assert_kv_clean, random_prompts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not INTERPRETED:
    raise RuntimeError(
        "triton was imported before TRITON_INTERPRET=1 was set: run this module alone"
    )
TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


# --- helpers ------------------------------------------------------------------------------------


def paged_table(seq_lens: list[int], page_size: int, num_pages: int, seed: int) -> np.ndarray:
    """A token-level page table [bs, max_len] over randomly chosen (shuffled) pages."""
    rng = np.random.default_rng(seed)
    width = max(seq_lens)
    n_pages = -(-width // page_size)
    pages = rng.permutation(num_pages)[: len(seq_lens) * n_pages].reshape(len(seq_lens), n_pages)
    pos = np.arange(width)
    return (pages[:, pos // page_size] * page_size + pos % page_size).astype(np.int32)


def make_plan(prefix: list[int], ext: list[int], page_size: int, num_pages: int, decode: bool):
    table = paged_table([p + e for p, e in zip(prefix, ext)], page_size, num_pages, seed=len(ext))
    bs = len(ext)
    ids = np.zeros(sum(ext), dtype=np.int32)
    return build_step_plan(table, np.arange(bs), prefix, ext, ids, np.ones(bs, bool), not decode)


def reference(q, k_cache, v_cache, plan, window):
    """Plain PyTorch attention in fp32: [T, H, D] (causal, window, GQA by repeat)."""
    gqa = q.shape[1] // k_cache.shape[1]
    out, q0 = [], 0
    for r, (ext, n) in enumerate(zip(plan.extend_lens.tolist(), plan.seq_lens.tolist())):
        loc = torch.from_numpy(plan.kv_indices[plan.kv_indptr[r] : plan.kv_indptr[r] + n]).long()
        k = k_cache[loc.to(k_cache.device)].float().repeat_interleave(gqa, 1)
        v = v_cache[loc.to(v_cache.device)].float().repeat_interleave(gqa, 1)
        qs = q[q0 : q0 + ext].float()
        s = torch.einsum("qhd,khd->hqk", qs, k) / q.shape[-1] ** 0.5
        q_pos = torch.arange(n - ext, n, device=q.device)[:, None]
        kv_pos = torch.arange(n, device=q.device)[None, :]
        mask = kv_pos <= q_pos
        if window is not None:
            mask &= kv_pos > q_pos - window
        s = s.masked_fill(~mask, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        q0 += ext
    return torch.cat(out)


def fused_qkv(t: int, h: int, kvh: int, d: int, dtype, gen):
    """q, k, v as views of one fused projection (strided, like a QKV matmul's output)."""
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen).to(DEVICE, dtype)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
    return q, k, v


def filled_pool(kvh: int, d: int, dtype, page_size: int, num_pages: int, gen) -> KVPool:
    pool = KVPool(1, num_pages, page_size, kvh, d, dtype, DEVICE)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    return pool


def run_step(backend_cls, pool, plan, q, k, v, window, **kw):
    h, kvh, d = q.shape[1], k.shape[1], q.shape[2]
    backend = backend_cls(pool, h, kvh, d, window, DEVICE, **kw)
    return backend.forward(0, q, k, v, backend.prepare(plan)).view(q.shape)


def clone_pool(pool: KVPool) -> KVPool:
    twin = KVPool(1, pool.num_pages, pool.page_size, *pool.k[0].shape[1:], pool.k[0].dtype, DEVICE)
    twin.k[0].copy_(pool.k[0])
    twin.v[0].copy_(pool.v[0])
    return twin


def check_step(prefix, ext, page_size, kvh, gqa, d, window, dtype, seed, **backend_kw):
    """One layer of one step through the triton backend vs torch-native (same pool contents)
    and vs the fp32 reference; returns the triton output."""
    gen = torch.Generator().manual_seed(seed)
    decode = all(e == 1 for e in ext) and any(prefix)
    num_pages = -(-max(p + e for p, e in zip(prefix, ext)) // page_size) * len(ext) + 4
    plan = make_plan(prefix, ext, page_size, num_pages, decode)
    pool = filled_pool(kvh, d, dtype, page_size, num_pages, gen)
    twin = clone_pool(pool)
    q, k, v = fused_qkv(sum(ext), kvh * gqa, kvh, d, dtype, gen)
    got = run_step(TritonBackend, pool, plan, q, k, v, window, **backend_kw)
    want = run_step(TorchNativeBackend, twin, plan, q, k, v, window)
    assert torch.equal(pool.k[0], twin.k[0]) and torch.equal(pool.v[0], twin.v[0])
    assert got.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(got.float(), reference(q, pool.k[0], pool.v[0], plan, window), **tol)
    return got


# --- kernels against torch-native and the reference -----------------------------------------

# (page_size, kv heads, gqa, head_dim, sliding window, splits)
DECODE_CASES = [
    (1, 2, 1, 16, None, 1),
    (4, 1, 4, 32, None, 3),
    (4, 2, 1, 16, 7, 3),
    (1, 1, 4, 64, 20, 2),
]


@pytest.mark.parametrize(("page_size", "kvh", "gqa", "d", "window", "splits"), DECODE_CASES)
def test_decode_matches_torch_native_fp32(page_size, kvh, gqa, d, window, splits):
    # the new token of row 1 crosses a page boundary for page_size 4
    check_step([40, 3, 17], [1, 1, 1], page_size, kvh, gqa, d, window, torch.float32,
               seed=gqa * 10 + splits, max_kv_splits=splits, block_n=16)  # fmt: skip


# (page_size, kv heads, gqa, head_dim, sliding window): prefixes and new tokens of each
# request cross query and KV blocks (16) and pages; one request is a fresh prompt, one a
# single-token extend.
EXTEND_CASES = [
    (1, 2, 1, 16, None),
    (4, 1, 4, 32, None),
    (4, 2, 1, 16, 10),
    (1, 1, 4, 64, 5),
]


@pytest.mark.parametrize(("page_size", "kvh", "gqa", "d", "window"), EXTEND_CASES)
def test_extend_matches_torch_native_fp32(page_size, kvh, gqa, d, window):
    check_step([0, 9, 30], [13, 21, 1], page_size, kvh, gqa, d, window, torch.float32,
               seed=gqa * 10 + d, block_m=16, block_n=16)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "extend"])
def test_half_precision_against_fp32_reference(dtype, decode):
    prefix, ext = ([25, 6], [1, 1]) if decode else ([0, 11], [18, 9])
    check_step(prefix, ext, 4, 2, 2, 32, 12, dtype, seed=7, max_kv_splits=2, block_m=16,
               block_n=16)  # fmt: skip


def test_split_kv_merges_to_the_unsplit_result():
    """Splits (some empty for short rows) merged by the reduce kernel equal one split."""
    gen = torch.Generator().manual_seed(3)
    kvh, gqa, d = 2, 2, 16
    plan = make_plan([70, 2, 33], [1, 1, 1], 1, 256, decode=True)
    pool = filled_pool(kvh, d, torch.float32, 1, 256, gen)
    q = torch.randn(3, kvh * gqa, d, generator=gen).to(DEVICE)
    args = [
        torch.from_numpy(a).to(DEVICE) for a in (plan.kv_indptr, plan.kv_indices, plan.seq_lens)
    ]
    outs = []
    for splits in (1, 5):
        out = torch.empty_like(q)
        buf = DecodeBuffers.empty(3, kvh * gqa, splits, d, DEVICE)
        decode_attention(q, pool.k[0], pool.v[0], *args, buf, out, None, block_n=16)
        outs.append(out)
        if splits == 5:  # row 1 (3 tokens) fills one split: the others carry lse = -inf
            assert torch.isinf(buf.lse[1]).sum() == 4 * kvh * gqa
    torch.testing.assert_close(outs[1], outs[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(outs[0], reference(q, pool.k[0], pool.v[0], plan, None),
                               **TOL[torch.float32])  # fmt: skip


def test_decode_scratch_is_one_buffer_for_every_batch_size():
    """Split scratch does not pile up per batch size: views of one buffer sized by the largest."""
    pool = KVPool(1, 64, 1, 2, 16, torch.float32, DEVICE)
    backend = TritonBackend(pool, 8, 2, 16, None, DEVICE, max_kv_splits=3)
    big = backend.decode_buffers(8)
    size = backend._scratch.numel()
    assert size == DecodeBuffers.numel(8, 8, backend.num_kv_splits(8), 16)
    small = backend.decode_buffers(2)
    assert backend._scratch.numel() == size and small.o.data_ptr() == big.o.data_ptr()
    assert small.o.shape == (2, 8, backend.num_kv_splits(2), 16)
    assert small.lse.shape == (2, 8, backend.num_kv_splits(2))
    assert small.lse.data_ptr() >= small.o.data_ptr() + small.o.numel() * 4  # no overlap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_exactly_the_new_rows(dtype):
    gen = torch.Generator().manual_seed(1)
    pool = filled_pool(3, 24, dtype, 4, 8, gen)  # head_dim 24, 3 heads: padded blocks
    before_k, before_v = pool.k[0].clone(), pool.v[0].clone()
    _, k, v = fused_qkv(5, 2, 3, 24, dtype, gen)
    loc = torch.tensor([9, 0, 31, 4, 17], device=DEVICE, dtype=torch.int32)
    store_kv(k, v, pool.k[0], pool.v[0], loc)
    before_k[loc.long()], before_v[loc.long()] = k, v
    assert torch.equal(pool.k[0], before_k) and torch.equal(pool.v[0], before_v)


def test_extend_blocks_cover_every_query_once():
    req, start = extend_blocks(np.array([5, 0, 33, 16]), 16)
    assert req.tolist() == [0, 2, 2, 2, 3]
    assert start.tolist() == [0, 0, 16, 32, 0]


def test_extend_of_an_empty_step_is_a_no_op():
    q = torch.empty(0, 2, 16, device=DEVICE)
    out = torch.empty_like(q)
    cache = torch.zeros(4, 1, 16, device=DEVICE)
    z = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    e = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    assert extend_attention(q, cache, cache, z, z, e, e, e, e, out) is out


# --- the registry: triton by name, auto, unavailable ----------------------------------------


def test_registry_names_and_auto_choice(caplog):
    assert {"auto", "torch_native", "triton"} <= set(available_backends())
    assert unavailable_reason("triton") is None
    with caplog.at_level("INFO", logger="minisgl.attention"):
        assert resolve_backend("auto", torch.device("cpu")) == "torch_native"
        assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert "device is cpu" in caplog.text and "CUDA device and triton imports" in caplog.text
    assert resolve_backend("triton", torch.device("cpu")) == "triton"


def test_missing_dependency_makes_only_that_backend_unavailable(monkeypatch, caplog):
    monkeypatch.setitem(_OPTIONAL, "triton", "minisgl._no_such_module_")
    monkeypatch.delitem(__import__("minisgl.attention", fromlist=["_REGISTRY"])._REGISTRY, "triton")
    reason = unavailable_reason("triton")
    assert reason is not None and "ModuleNotFoundError" in reason and "_no_such_module_" in reason
    pool = KVPool(1, 4, 1, 1, 16, torch.float32, torch.device("cpu"))
    kw = dict(pool=pool, num_heads=1, num_kv_heads=1, head_dim=16, sliding_window=None)
    with pytest.raises(RuntimeError, match="'triton' is unavailable: ModuleNotFoundError"):
        create_backend("triton", device=torch.device("cpu"), **kw)
    with caplog.at_level("INFO", logger="minisgl.attention"):
        assert resolve_backend("auto", torch.device("cuda")) == "torch_native"
    assert "_no_such_module_" in caplog.text
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        create_backend("flash", device=torch.device("cpu"), **kw)


def test_cpu_without_the_interpreter_is_refused(monkeypatch):
    import minisgl.attention.triton_backend as tb

    monkeypatch.setattr(tb, "INTERPRETED", False)
    pool = KVPool(1, 4, 1, 1, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="needs a CUDA device.*TRITON_INTERPRET=1"):
        TritonBackend(pool, 1, 1, 16, None, torch.device("cpu"))


def test_llm_auto_on_cpu_uses_torch_native(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), device="cpu", attention_backend="auto", num_pages=64)
    assert isinstance(llm.engine.backend, TorchNativeBackend)


# --- greedy parity with HF through LLM(attention_backend="triton") --------------------------

NEW = 5


@pytest.mark.parametrize(("arch", "page_size"), [("llama", 4), ("mistral", 1)])
def test_greedy_parity_with_hf(arch, page_size, tiny_model_dir):
    """Batched prefill in chunks, decode, then prompts that hit the prefix cache. Mistral's
    prompts outgrow its sliding window (48) so both prefill and decode use the window."""
    path = tiny_model_dir(arch)
    lo, hi = (20, 40) if arch == "llama" else (50, 62)
    prompts = random_prompts(2, lo, hi, seed=11)
    prompts.append(prompts[0][:30] + random_prompts(1, 4, 8, seed=12)[0])  # shares a prefix
    ref = hf_greedy(load_hf_model(path), prompts, NEW)
    llm = LLM(path, device=DEVICE.type, dtype="float32", attention_backend="triton",
              page_size=page_size, num_pages=512 // page_size, max_extend_tokens=24)  # fmt: skip
    assert isinstance(llm.engine.backend, TritonBackend)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    first = llm.generate(prompts[:2], greedy)
    assert llm.scheduler.stats.steps > NEW  # the prompts went in chunks of 24 tokens
    assert llm.scheduler.stats.cached_prompt_tokens == 0
    hit = llm.generate(prompts[2:], greedy)
    assert llm.scheduler.stats.cached_prompt_tokens >= 30 - page_size
    assert [o["token_ids"] for o in first + hit] == ref
    assert_kv_clean(llm)


@pytest.mark.card(
    "P2-001", "cpu-stand-in-bucket-choice-padding-isolation-hf-parity-no-host-reads-in-replay"
)
@pytest.mark.parametrize(("arch", "page_size"), [("qwen2", 4), ("mistral", 1)])
def test_decode_graphs_with_triton_match_hf(arch, page_size, tiny_model_dir):
    """The triton backend's graph metadata (`graph_prepare`: the fixed buffers, the split
    scratch of each bucket) through the graph stand-in: 3 requests on bucket 4, then 1 and 2
    as they finish; Mistral decodes past its sliding window."""
    from minisgl.engine.graph_runner import ReplayGraphRunner

    path = tiny_model_dir(arch)
    lo, hi = (8, 16) if arch == "qwen2" else (44, 50)
    prompts = random_prompts(3, lo, hi, seed=5)
    lengths = [2, 6, 4]
    ref = hf_greedy(load_hf_model(path), prompts, max(lengths))
    # warm_up=False: no warm-up replays in the count below (a GPU warms up else)
    llm = LLM(path, device=DEVICE.type, dtype="float32", attention_backend="triton",
              graph_runner="replay", cuda_graph_max_bs=4, page_size=page_size,
              num_pages=512 // page_size, max_seq_len_override=64, warm_up=False)  # fmt: skip
    runner = llm.engine.graphs
    assert isinstance(runner, ReplayGraphRunner) and runner.buckets == (1, 2, 4)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    out = llm.generate(prompts, params)
    assert [o["token_ids"] for o in out] == [r[:n] for r, n in zip(ref, lengths, strict=True)]
    assert runner.replays == max(lengths) - 1
    assert_kv_clean(llm)


# --- GPU: compiled kernels at realistic sizes -------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1024])
def test_gpu_decode_realistic(dtype, window):
    prefix = torch.randint(1, 4096, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    check_step(prefix, [1] * 32, 16, 8, 4, 128, window, dtype, seed=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 700])
def test_gpu_extend_realistic(dtype, window):
    check_step([0, 1000, 37, 2048], [1500, 512, 1, 300], 16, 8, 4, 128, window, dtype, seed=1)


@pytest.mark.gpu
def test_gpu_decode_grid_is_fixed_per_batch_size_and_graph_capturable():
    """The decode step replays in a CUDA graph over new sequence lengths (same batch size)."""
    gen = torch.Generator().manual_seed(2)
    bs, kvh, gqa, d = 8, 2, 4, 64
    pool = filled_pool(kvh, d, torch.float16, 1, 8192, gen)
    backend = TritonBackend(pool, kvh * gqa, kvh, d, None, DEVICE)
    plan = make_plan([900] * bs, [1] * bs, 1, 8192, decode=True)  # the longest: sizes buffers
    meta = backend.prepare(plan)
    q, k, v = fused_qkv(bs, kvh * gqa, kvh, d, torch.float16, gen)
    backend.forward(0, q, k, v, meta)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(0, q, k, v, meta)
    shorter = make_plan([100] * bs, [1] * bs, 1, 8192, decode=True)
    new = backend.prepare(shorter)
    assert new.decode.o.data_ptr() == meta.decode.o.data_ptr()  # the same scratch
    assert new.decode.lse.data_ptr() == meta.decode.lse.data_ptr()
    meta.kv_indices[: new.kv_indices.shape[0]].copy_(new.kv_indices)
    for name in ("out_loc", "kv_indptr", "seq_lens"):
        getattr(meta, name).copy_(getattr(new, name))
    graph.replay()
    ref = reference(q, pool.k[0], pool.v[0], shorter, None)
    torch.testing.assert_close(out.view(q.shape).float(), ref, **TOL[torch.float16])


# --- compile for a GPU without one ----------------------------------------------------------

_COMPILE_SM90 = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minisgl.attention.triton_kernels import decode, extend, kv_store

def build(fn, types, consts):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32))

for dt, prec in [a.split(":") for a in sys.argv[1:]]:
    ptr = lambda *names: {n: "*" + dt for n in names}
    i32 = lambda *names: {n: "*i32" for n in names}
    block = 64 if dt == "bf16" else 32
    kernels = [
        build(kv_store._store_kv_kernel, {**ptr("K", "V", "K_CACHE", "V_CACHE"), **i32("OUT_LOC")},
              dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128)),
        build(decode._decode_split_kernel,
              {**ptr("Q", "K_CACHE", "V_CACHE"), **i32("KV_INDPTR", "KV_INDICES", "SEQ_LENS"),
               "MID_O": "*fp32", "MID_LSE": "*fp32", "scale_log2": "fp32"},
              dict(GQA=4, HEAD_DIM=128, NUM_HEADS=32, NUM_SPLITS=8, HAS_WINDOW=True, BLOCK_H=16,
                   BLOCK_D=128, BLOCK_N=block, PRECISION=prec, UPCAST=False)),
        build(decode._decode_reduce_kernel, {"MID_O": "*fp32", "MID_LSE": "*fp32", "OUT": "*" + dt},
              dict(HEAD_DIM=128, NUM_HEADS=32, NUM_SPLITS=8, BLOCK_S=8, BLOCK_D=128)),
        build(extend._extend_kernel,
              {**ptr("Q", "K_CACHE", "V_CACHE", "OUT"), "scale_log2": "fp32",
               **i32("Q_INDPTR", "KV_INDPTR", "KV_INDICES", "SEQ_LENS", "BLOCK_REQ", "BLOCK_START")},
              dict(GQA=4, HEAD_DIM=128, HAS_WINDOW=True, BLOCK_M=block, BLOCK_N=block,
                   BLOCK_D=128, PRECISION=prec, UPCAST=False)),
    ]
    assert all(len(k.asm["cubin"]) > 0 for k in kernels)
    print(dt, "ok", [k.metadata.shared for k in kernels])
"""


@pytest.mark.slow
def test_kernels_compile_to_sm90_cubins():
    """Not a GPU run: the compiled (not interpreted) kernels go through triton's whole
    pipeline, ptxas included, for an H100 (sm_90), in bf16 and fp32, in a fresh process."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    cmd = [sys.executable, "-c", _COMPILE_SM90, "bf16:tf32", "fp32:ieee"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "bf16 ok" in res.stdout and "fp32 ok" in res.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_single_split_decode_is_one_launch_with_the_merged_bits(dtype):
    """With one split a request's partial output is its output: the split kernel writes it in
    the output's dtype and the merge is not launched (Qwen3-0.6B decodes with one split from
    33 requests on an H200: the merge was 28 of a step's launches, ~0.1 ms of a 6.4 ms step).
    The merge of one split changed nothing: its weight is exp2(0) = 1."""
    from minisgl.testing.launches import count_launches

    gen = torch.Generator().manual_seed(5)
    kvh, gqa, d = 2, 2, 16
    plan = make_plan([70, 2, 33], [1, 1, 1], 1, 256, decode=True)
    pool = filled_pool(kvh, d, dtype, 1, 256, gen)
    q = torch.randn(3, kvh * gqa, d, generator=gen).to(DEVICE, dtype)
    args = [
        torch.from_numpy(a).to(DEVICE) for a in (plan.kv_indptr, plan.kv_indices, plan.seq_lens)
    ]
    buf = DecodeBuffers.empty(3, kvh * gqa, 1, d, DEVICE)
    out = torch.empty_like(q)
    with count_launches() as launches:
        decode_attention(q, pool.k[0], pool.v[0], *args, buf, out, None, block_n=16)
    assert dict(launches.counts) == {"triton:_decode_split_kernel": 1}
    two = DecodeBuffers.empty(3, kvh * gqa, 2, d, DEVICE)
    ref = torch.empty_like(q)
    decode_attention(q, pool.k[0], pool.v[0], *args, two, ref, None, block_n=16)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(out.float(), reference(q, pool.k[0], pool.v[0], plan, None).float(),
                               **TOL[dtype])  # fmt: skip
