"""The fused decode-layer kernels (`minisgl/kernels/triton`) against the torch reference the
CPU path runs (`models/layers.py`, `F.silu`): fp32 within a few ulp, fp16 / bf16 within one
rounding of the model dtype.

Without CUDA they run in Triton's interpreter on CPU tensors: TRITON_INTERPRET=1 is set here
before triton is first imported (see `test_triton_attention.py`)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.nn.functional as F

from minisgl.kernels.triton import add_rms_norm_, rms_norm, rope_, silu_and_mul
from minisgl.models.layers import apply_rope
from minisgl.models.layers import rms_norm as rms_norm_ref
from minisgl.testing.launches import count_launches

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {
    torch.float32: dict(atol=2e-6, rtol=2e-6),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=8e-3, rtol=8e-3),
}


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def rope_tables(max_pos: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [max_pos, d] as `RotaryEmbedding` builds them."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin = torch.cat((-sin[:, : d // 2], sin[:, d // 2 :]), dim=-1)
    return emb.cos().to(DEVICE, dtype), sin.to(DEVICE, dtype)


# --- RMSNorm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])  # 96: a block wider than the row (masked lanes)
def test_rms_norm_matches_the_reference(dtype, hidden):
    x = randn(5, hidden, dtype=dtype, seed=0, scale=3.0)
    w = randn(hidden, dtype=dtype, seed=1)
    want = rms_norm_ref(x, w, 1e-6)
    got = rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_in_place(dtype):
    """residual += x (rounded to the dtype, as torch adds); x = RMSNorm(residual)."""
    x = randn(4, 96, dtype=dtype, seed=2)
    res = randn(4, 96, dtype=dtype, seed=3, scale=4.0)
    w = randn(96, dtype=dtype, seed=4)
    want_res = res + x
    want = rms_norm_ref(want_res, w, 1e-5)
    x_ptr, res_ptr = x.data_ptr(), res.data_ptr()
    assert add_rms_norm_(x, res, w, 1e-5) is None
    assert x.data_ptr() == x_ptr and res.data_ptr() == res_ptr
    assert torch.equal(res, want_res)  # one add, one rounding: exact
    torch.testing.assert_close(x, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_final_norm_adds_and_gathers_rows(dtype):
    """The last norm of a step: RMSNorm(x + residual) of the sampled rows only, nothing
    written back."""
    x = randn(6, 64, dtype=dtype, seed=5)
    res = randn(6, 64, dtype=dtype, seed=6)
    w = randn(64, dtype=dtype, seed=7)
    rows = torch.tensor([5, 0, 3], dtype=torch.int64, device=DEVICE)
    x0, res0 = x.clone(), res.clone()
    got = rms_norm(x, w, 1e-6, residual=res, rows=rows)
    want = rms_norm_ref((res + x)[rows], w, 1e-6)
    assert got.shape == (3, 64)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(x, x0) and torch.equal(res, res0)


# --- RoPE (and Qwen3's q/k RMSNorm) in place -------------------------------------------------


def qkv_views(t: int, h: int, kvh: int, d: int, dtype: torch.dtype, seed: int):
    """The fused QKV output and q, k, v as its strided views, as the model splits it."""
    qkv = randn(t, (h + 2 * kvh) * d, dtype=dtype, seed=seed, scale=2.0)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
    return qkv, q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("h", "kvh", "d"), [(4, 2, 16), (3, 1, 24)])  # 24: half of 12, masked
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk_norm+rope"])
def test_rope_in_place_matches_the_reference(dtype, h, kvh, d, qk_norm):
    cos, sin = rope_tables(64, d, dtype)
    positions = torch.tensor([0, 7, 63, 30, 1], dtype=torch.int32, device=DEVICE)
    qkv, q, k, v = qkv_views(5, h, kvh, d, dtype, seed=h * d)
    v0 = v.clone()
    qw = randn(d, dtype=dtype, seed=11) if qk_norm else None
    kw = randn(d, dtype=dtype, seed=12) if qk_norm else None
    rq, rk = q.clone(), k.clone()
    if qk_norm:
        rq, rk = rms_norm_ref(rq, qw, 1e-6), rms_norm_ref(rk, kw, 1e-6)
    cos_sin = (cos[positions.long()][:, None, :], sin[positions.long()][:, None, :])
    want_q, want_k = apply_rope(rq, rk, cos_sin)
    ptr = qkv.data_ptr()
    assert rope_(q, k, positions, cos, sin, q_norm=qw, k_norm=kw, eps=1e-6) is None
    assert qkv.data_ptr() == ptr
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    assert torch.equal(v, v0)  # v, between k's rows in the same buffer, untouched


def test_rope_reads_int64_positions_and_an_empty_step():
    cos, sin = rope_tables(32, 16, torch.float32)
    _, q, k, _ = qkv_views(2, 2, 2, 16, torch.float32, seed=3)
    want = apply_rope(q.clone(), k.clone(), (cos[[4, 31]][:, None], sin[[4, 31]][:, None]))
    rope_(q, k, torch.tensor([4, 31], device=DEVICE), cos, sin)
    torch.testing.assert_close((q, k), want, **TOL[torch.float32])
    _, q0, k0, _ = qkv_views(0, 2, 2, 16, torch.float32, seed=3)
    rope_(q0, k0, torch.zeros(0, dtype=torch.int32, device=DEVICE), cos, sin)


CARD = "P2-001"
RED = "host-work-and-fusion-tests-fail-before-the-change"
GREEN = "host-work-and-fusion-tests-pass"


def fused_op(name: str):
    """An op of `kernels.triton` by name (a missing one fails the test, not its import)."""
    import minisgl.kernels.triton as ops

    assert hasattr(ops, name), f"minisgl.kernels.triton has no {name}"
    return getattr(ops, name)


@pytest.mark.card(CARD, "rope-writes-k-and-v-into-the-pool-in-its-own-launch", RED, GREEN)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk_norm+rope"])
def test_rope_stores_the_rotated_k_and_v_into_the_pool(dtype, qk_norm):
    """`rope_(..., v=v, cache=KVSlots(k_cache, v_cache, out_loc))`: q and k rotated in place
    exactly as without it, and the rotated k and v written to the pool rows `out_loc` (the
    KV store of the attention backend, in the same launch); no other pool row changes."""
    h, kvh, d = 4, 2, 24
    cos, sin = rope_tables(64, d, dtype)
    positions = torch.tensor([0, 7, 63, 30, 1], dtype=torch.int32, device=DEVICE)
    out_loc = torch.tensor([3, 17, 39, 0, 22], dtype=torch.int32, device=DEVICE)
    qw = randn(d, dtype=dtype, seed=11) if qk_norm else None
    kw = randn(d, dtype=dtype, seed=12) if qk_norm else None
    _, q, k, v = qkv_views(5, h, kvh, d, dtype, seed=5)
    _, want_q, want_k, _ = qkv_views(5, h, kvh, d, dtype, seed=5)
    rope_(want_q, want_k, positions, cos, sin, q_norm=qw, k_norm=kw, eps=1e-6)
    k_cache = randn(40, kvh, d, dtype=dtype, seed=20)
    v_cache = randn(40, kvh, d, dtype=dtype, seed=21)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    want_k_cache[out_loc.long()] = want_k
    want_v_cache[out_loc.long()] = v
    slots = fused_op("KVSlots")(k_cache, v_cache, out_loc)
    rope_(q, k, positions, cos, sin, q_norm=qw, k_norm=kw, eps=1e-6, v=v, cache=slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)  # the same kernel arithmetic
    assert torch.equal(k_cache, want_k_cache)
    assert torch.equal(v_cache, want_v_cache)


# --- the greedy argmax ---------------------------------------------------------------------------


@pytest.mark.card(CARD, "greedy-argmax-and-bad-row-flag-in-two-launches", RED, GREEN)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1000, 5003])  # 5003: the last block of a row is partial
def test_argmax_rows_matches_torch_max(dtype, vocab):
    """`argmax_rows(x)` -> int64 [2, rows]: row 0 is torch.max's index (the first maximum,
    a NaN counting as the maximum), row 1 flags a row whose maximum is not finite."""
    x = randn(7, vocab, dtype=dtype, seed=vocab, scale=4.0)
    x[1, 10] = x[1, vocab - 3] = 50.0  # a tie across blocks: the first index wins
    x[2, 5] = x[2, 900] = float("nan")  # NaN: the maximum, its first index
    x[3, vocab // 2] = float("inf")
    x[4] = float("-inf")  # every token masked: index 0, not finite
    x[5, vocab - 1] = 60.0  # the maximum in the last (partial) block
    top, want = x.float().max(dim=-1)
    argmax_rows = fused_op("argmax_rows")
    with count_launches() as launches:
        got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (2, 7)
    assert got[0].tolist() == want.tolist()
    assert got[1].tolist() == [int(not f) for f in torch.isfinite(top).tolist()]
    assert got[1].tolist() == [0, 0, 1, 1, 1, 0, 0]
    assert launches.total <= 2, launches.counts


# --- SiLU and mul -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [128, 100])  # 100: the last column block is partial
def test_silu_and_mul_matches_the_reference(dtype, inter):
    x = randn(3, 2 * inter, dtype=dtype, seed=inter, scale=3.0)
    gate, up = x.split(inter, dim=-1)
    want = F.silu(gate) * up
    got = silu_and_mul(x)
    assert got.shape == (3, inter) and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


# --- compile for a GPU without one --------------------------------------------------------------

_COMPILE_SM90 = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minisgl.kernels.triton import activation, argmax, norm, rope

def build(fn, types, consts, **options):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options=options)

for dt in sys.argv[1:]:
    ptr = lambda *names: {n: "*" + dt for n in names}
    kernels = [
        build(norm._rms_norm_kernel, {**ptr("X", "R", "W", "OUT"), "ROWS": "*i64", "eps": "fp32"},
              dict(N=896, BLOCK=1024, HAS_RESIDUAL=True, STORE_RESIDUAL=True, HAS_ROWS=False,
                   BF16_RNE=False), num_warps=4),
        build(norm._rms_norm_kernel, {**ptr("X", "R", "W", "OUT"), "ROWS": "*i64", "eps": "fp32"},
              dict(N=1024, BLOCK=1024, HAS_RESIDUAL=True, STORE_RESIDUAL=False, HAS_ROWS=True,
                   BF16_RNE=False), num_warps=4),
        *(build(rope._rope_kernel, {**ptr("Q", "K", "COS", "SIN", "QW", "KW", "V", "K_CACHE",
                                          "V_CACHE"), "POS": "*i32", "OUT_LOC": "*i32",
                                    "eps": "fp32"},
                dict(NUM_Q=16, NUM_K=8, HALF=64, BLOCK_Q=16, BLOCK_K=8, BLOCK_HALF=64,
                     QK_NORM=True, BF16_RNE=False, STORE_KV=store), enable_fp_fusion=False)
          for store in (False, True)),
        build(argmax._argmax_blocks_kernel, {"X": "*" + dt, "VALS": "*fp32", "IDXS": "*i32"},
              dict(BLOCK_V=4096), num_warps=8),
        build(argmax._argmax_merge_kernel, {"VALS": "*fp32", "IDXS": "*i32", "OUT": "*i64"},
              dict(BLOCK_B=64)),
        build(activation._silu_and_mul_kernel, ptr("X", "OUT"),
              dict(N=4864, BLOCK=1024, BF16_RNE=False)),
    ]
    assert all(len(k.asm["cubin"]) > 0 for k in kernels)
    print(dt, "ok")
"""


@pytest.mark.slow
def test_kernels_compile_to_sm90_cubins():
    """Not a GPU run: the compiled (not interpreted) kernels go through triton's whole
    pipeline, ptxas included, for an H100 (sm_90), bf16 and fp32, in a fresh process."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-c", _COMPILE_SM90, "bf16", "fp32"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "bf16 ok" in res.stdout and "fp32 ok" in res.stdout
