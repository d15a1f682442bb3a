"""The CPU kernels in C, built on first use with the system C compiler (the one inductor uses
for compiled decode) and called through ctypes: attention (`decode_attention.c`,
`prefill_attention.c`, `prefill_amx.c`), the KV store, the int4 / int8 de-quantization and
GEMVs, w8a8's input quantization, the sampler's row argmax, the one-call decode step
(`decode_step.c`) and deterministic mode's batch-invariant AMX GEMM (`amx_gemm.c`). Used by the attention backends, the quantized linears, the sampler and
the engine's C decode step: the layers above share them from here.

`decode_attention(q, k, v, lens, window)` is a torch custom op (`minisgl::cpu_decode_attention`)
so a compiled decode graph calls it as one opaque kernel. It replaces SDPA for decode steps on
a CPU: with a few query rows per KV head ([bs, KVH, gqa, D] against [bs, KVH, L, D]), SDPA's
flash kernel spends most of its time per (request, head) block rather than on the K / V bytes:
measured 526 us against 233 us for this kernel at batch 16 x 265 positions (bf16, 2 threads).

The shared object is cached per source, flags and CPU (it is built with -march=native) under
the user cache directory; a machine without a compiler falls back to SDPA (logged once), as
does `MINISGL_CPU_ATTENTION=sdpa`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from minisgl.kernels.oplib import define_op
from minisgl.utils.cpu import cpu_flags, march_flags
from minisgl.utils.log import get_logger

logger = get_logger(__name__)

_HERE = Path(__file__).parent
SOURCES = tuple(
    _HERE / f"{name}.c"
    for name in (
        "decode_attention",
        "prefill_attention",
        "prefill_amx",
        "amx_gemm",
        "row_max",
        "kv_store",
        "dequant",
        "quant",
        "prefill_ops",
        "decode_step",
        "decode_step_w8a8",
    )
)
HEADERS = (_HERE / "amx_tiles.h", _HERE / "bf16.h", _HERE / "rowops.h", _HERE / "spans.h",
           _HERE / "vexp.h")  # fmt: skip
# -ffast-math at compile time only: linked with it, the object would set flush-to-zero for
# the whole process when loaded (crtfastmath), changing every fp32 op in torch
# 512-bit vectors where the CPU has them (gcc prefers 256 on most AVX-512 parts): the softmax's
# expf loop 16 wide; a tuning flag, without effect elsewhere.
# -fno-reciprocal-math -mno-recip: no rcpps / rsqrtss for divisions and 1 / sqrtf, whose bits
# each vendor defines (Intel and AMD differ): the same numbers on every x86 kind, the inverse
# root a correctly rounded square root and division as torch's rsqrt (issue 59)
COMPILE_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math",
                 "-fno-reciprocal-math", "-mno-recip", "-fopenmp", "-fPIC", "-c")  # fmt: skip
LINK_FLAGS = ("-shared", "-fopenmp")
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_ERRORS = {1: "head_dim > 256 or more than 16 query heads per KV head", 2: "a length outside 1..L",
           3: "out of memory", 4: "a KV index outside the pool",
           5: "indptr outside the indices", 6: "a request's query rows outside q",
           7: "a request's KV range outside the indices", 8: "no AMX tiles on this CPU",
           9: "a shape the groups do not divide", 10: "an empty matrix"}  # fmt: skip
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
# q, k, v, out, indices, num_indices, q_starts, q_lens, kv_starts, kv_lens, 11 sizes / strides
_PREFILL_ARGS = [_PTR] * 5 + [_I64] + [_PTR] * 4 + [_I64] * 11


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep) or platform.machine()


def _cache_dir() -> Path:
    import platformdirs

    return Path(os.environ.get("MINISGL_KERNEL_CACHE") or platformdirs.user_cache_dir("minisgl"))


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build() -> Path:
    """The shared object for this source, flags and CPU (built once, atomically, under a lock:
    several processes may start at once)."""
    from filelock import FileLock

    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC)")
    texts = [f.read_text() for f in (*SOURCES, *HEADERS)]
    flags = (*COMPILE_FLAGS, *march_flags())  # MINISGL_CPU_ISA's cap (utils/cpu.py)
    key = hashlib.sha256(
        "\0".join((*texts, cc, *flags, *LINK_FLAGS, _cpu_id())).encode()
    ).hexdigest()[:16]
    out_dir = _cache_dir() / "kernels"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"attention-{key}.so"
    with FileLock(str(target) + ".lock"):
        if not target.exists():
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                objs = [str(Path(tmp) / f"{src.stem}.o") for src in SOURCES]
                lib = Path(tmp) / "k.so"
                # the sources compile side by side (a cold start waited ~9 s for them in a row),
                # as processes of their own: no executor, which refuses work once the
                # interpreter shuts down (`prebuild`'s thread may still be building then)
                compiles = [[cc, *flags, "-o", obj, str(src)] for obj, src in zip(objs, SOURCES)]
                quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
                procs = [subprocess.Popen(cmd, **quiet) for cmd in compiles]
                codes = [proc.wait() for proc in procs]  # all done before any error is raised
                for cmd in (c for c, code in zip(compiles, codes) if code != 0):
                    _compile(cmd, check=True)  # raises with the compiler's messages
                _compile([cc, *LINK_FLAGS, "-o", str(lib), *objs, "-lm"], check=True)
                os.replace(lib, target)
    return target


def prebuild() -> None:
    """Start `build` in a background thread, so that a cold start compiles the kernels (~3 s on
    2 cores) beside the model's conversion and load instead of after them; the first use
    (`_library`) waits for it on the build's file lock, and reports its errors. Nothing when
    the kernels are off or there is no compiler."""
    if os.environ.get("MINISGL_CPU_ATTENTION", "native") == "sdpa" or _compiler() is None:
        return

    def run() -> None:
        with contextlib.suppress(Exception):  # the first use builds again: raises or warns
            build()

    # not a daemon: a process that ends early (a bad model path) waits the build out instead of
    # leaving the compilers' half-written temp folder in the cache
    threading.Thread(target=run, name="minisgl-kernel-build", daemon=False).start()


def _compile(cmd: list[str], check: bool = False) -> bool:
    """Run one compiler command; with `check`, a failure raises with its messages."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 and check:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
    return done.returncode == 0


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("MINISGL_CPU_ATTENTION", "native") == "sdpa":
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError) as e:
        logger.warning("CPU attention kernels unavailable (%s): attention uses SDPA", e)
        return None
    tail = [ctypes.c_float, ctypes.c_int]  # scale, threads
    lib.prefill_amx_supported.restype = ctypes.c_int
    lib.kv_store.restype = ctypes.c_int
    lib.kv_store.argtypes = [_PTR, _I64, _PTR, _I64, _PTR] + [_I64] * 3 + [ctypes.c_int]
    lib.dequant_int4_bf16.restype = ctypes.c_int
    lib.dequant_int4_bf16.argtypes = [_PTR] * 3 + [_I64] * 3 + [ctypes.c_int]
    lib.dequant_int8_bf16.restype = ctypes.c_int
    lib.dequant_int8_bf16.argtypes = [_PTR] * 3 + [_I64] * 2 + [ctypes.c_int]
    lib.quant_rows_bf16.restype = ctypes.c_int
    lib.quant_rows_bf16.argtypes = [_PTR, _I64, _PTR, _PTR, ctypes.c_float, ctypes.c_int,
                                    _PTR, _I64, ctypes.c_int, _PTR, _I64, _I64,
                                    ctypes.c_int]  # fmt: skip
    lib.scale_rows_bf16.restype = ctypes.c_int
    lib.scale_rows_bf16.argtypes = [_PTR, _I64, _PTR, _I64, _I64, ctypes.c_int]
    lib.rope_bf16.restype = ctypes.c_int
    lib.rope_bf16.argtypes = (
        [_PTR, _I64, _I64, _PTR, _I64, _I64] + [_PTR] * 4 + [_I64] * 2 + [ctypes.c_int]
    )
    lib.amx_gemm_supported.restype = ctypes.c_int
    lib.amx_gemm_bf16.restype = ctypes.c_int
    lib.amx_gemm_bf16.argtypes = [_PTR, _I64] + [_PTR] * 3 + [_I64] * 4 + [ctypes.c_int]
    lib.int4_gemv_bf16.restype = ctypes.c_int
    lib.int4_gemv_bf16.argtypes = [_PTR, _I64] + [_PTR] * 4 + [_I64] * 4 + [ctypes.c_int] * 2
    lib.decode_layers_bf16.restype = ctypes.c_int
    lib.decode_layers_bf16.argtypes = ([_PTR, _I64] + [_PTR] * 7 + [_I64] + [_PTR] * 2
                                       + [_I64] * 9 + [ctypes.c_float] + [ctypes.c_int] * 2)  # fmt: skip
    lib.w8a8_gemm_bf16.restype = ctypes.c_int
    lib.w8a8_gemm_bf16.argtypes = [_PTR, _I64] + [_PTR] * 4 + [_I64] * 3 + [ctypes.c_int]
    lib.int8_head_bf16.restype = ctypes.c_int
    lib.int8_head_bf16.argtypes = [_PTR, _I64] + [_PTR] * 3 + [_I64] * 3 + [ctypes.c_int]
    lib.decode_layers_w8a8_bf16.restype = ctypes.c_int
    lib.decode_layers_w8a8_bf16.argtypes = ([_PTR, _I64] + [_PTR] * 5 + [_I64] + [_PTR] * 2
                                            + [_I64] * 9 + [ctypes.c_float, ctypes.c_int])  # fmt: skip
    for suffix in _DTYPES.values():
        fn = getattr(lib, f"row_max_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = [_PTR] * 3 + [_I64] * 3 + [ctypes.c_int]
        for name, args in (
            (f"decode_attention_{suffix}", [_PTR] * 5 + [_I64] * 12),
            (f"decode_attention_{suffix}_paged", [_PTR] * 5 + [_I64, _PTR, _PTR] + [_I64] * 10),
            (f"prefill_attention_{suffix}", _PREFILL_ARGS),
            *([(f"prefill_attention_{suffix}_amx", _PREFILL_ARGS)] if suffix == "bf16" else []),
        ):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = args + tail
    return lib


def available(dtype: torch.dtype) -> bool:
    """Whether decode attention on a CPU in `dtype` runs through the kernel."""
    return dtype in _DTYPES and _library() is not None


def prefill_amx(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `prefill_attention` in `dtype` runs on AMX tiles here: bf16, head_dim a multiple
    of 32 (<= 256), a CPU with AMX-BF16 (its tile state granted by Linux), not turned off by
    MINISGL_CPU_AMX=0. Then every request of a step, any length, takes one kernel call."""
    lib = _library()
    return (dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256
            and lib is not None and os.environ.get("MINISGL_CPU_AMX", "1") != "0"
            and "amx_bf16" in cpu_flags()
            and bool(lib.prefill_amx_supported()))  # fmt: skip


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, window: int
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v for q [bs, KVH, gqa, D] over k, v [bs, KVH, L, D] (any
    strides, D contiguous), request b seeing positions [max(0, lens[b] - window), lens[b])
    (window <= 0: all of them); out [bs, KVH, gqa, D], q's dtype. `available(dtype)` first."""
    return torch.ops.minisgl.cpu_decode_attention(q, k, v, lens, window)


def _i64(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int64 and x.is_contiguous() else x.to(torch.int64).contiguous()


def _run(op: str, kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         *rest: int, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Call `kernel` ("decode_attention_{}", ...: {} takes q's dtype suffix) as (q, k, v, out,
    *rest, scale, threads), `rest` already ints (pointers as data_ptr()); a non-zero return
    code raises."""
    lib = _library()
    assert lib is not None and q.device.type == "cpu"
    if out is None:
        out = torch.empty_like(q)
    fn = getattr(lib, kernel.format(_DTYPES[q.dtype]))
    rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), *rest,
            q.shape[-1] ** -0.5, torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise ValueError(f"{op}: {_ERRORS.get(rc, rc)}")
    return out


def _decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, window: int
) -> torch.Tensor:
    q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    bs, kvh, gqa, d = q.shape
    ks, vs = k.stride(), v.stride()
    return _run(
        "cpu_decode_attention", "decode_attention_{}", q, k, v, _i64(lens).data_ptr(), bs, kvh,
        gqa, d, k.shape[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], window,
    )  # fmt: skip


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    indices: torch.Tensor,
    indptr: torch.Tensor,
    lens: torch.Tensor,
    window: int,
) -> torch.Tensor:
    """`decode_attention` read in place from a KV pool: k_pool, v_pool [rows, KVH, D] (D
    contiguous), request b's keys at pool rows indices[indptr[b] + l] for l < lens[b] (int64);
    the same window rule. No dense copy of the step's KV."""
    return torch.ops.minisgl.cpu_paged_decode_attention(
        q, k_pool, v_pool, indices, indptr, lens, window
    )


def _paged_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    indptr: torch.Tensor,
    lens: torch.Tensor,
    window: int,
) -> torch.Tensor:
    q = q.contiguous()
    bs, kvh, gqa, d = q.shape
    _check_pools("cpu_paged_decode_attention", q, k, v)
    if indptr.numel() != bs + 1 or lens.numel() != bs:
        raise ValueError("cpu_paged_decode_attention: indptr needs bs + 1 entries, lens bs")
    indices = _i64(indices)
    return _run(
        "cpu_paged_decode_attention", "decode_attention_{}_paged", q, k, v, indices.data_ptr(),
        indices.numel(), _i64(indptr).data_ptr(), _i64(lens).data_ptr(), bs, kvh, gqa, d,
        k.shape[0], k.stride(1), k.stride(0), v.stride(1), v.stride(0), window,
    )  # fmt: skip


def _check_pools(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """K / V pools [rows, KVH, D] with D contiguous, in q's dtype (the kernel reads all three
    as one element type)."""
    kvh, d = q.shape[1], q.shape[-1]
    if (k.shape != v.shape or k.shape[1:] != (kvh, d) or k.stride(-1) != 1
            or v.stride(-1) != 1 or not k.dtype == v.dtype == q.dtype):  # fmt: skip
        raise ValueError(f"{op}: pools {tuple(k.shape)} / {tuple(v.shape)} {k.dtype} for q "
                         f"{tuple(q.shape)} {q.dtype}")  # fmt: skip


def prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    indices: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    kv_starts: torch.Tensor,
    kv_lens: torch.Tensor,
    window: int,
    out: torch.Tensor | None = None,
    amx: bool | None = None,
) -> torch.Tensor:
    """Causal attention of a prefill step's requests, read in place from a KV pool: q, out
    [T, KVH, gqa, D]; request r's new tokens are q rows [q_starts[r], q_starts[r] + q_lens[r]),
    its keys pool rows indices[kv_starts[r] + l] for l < kv_lens[r] (prefix first), its token i
    sees positions < kv_lens[r] - q_lens[r] + i + 1 (and the last `window` of them when
    window > 0). Rows of `out` outside the requests keep their values (out None: a new,
    uninitialised tensor). `amx`: through the AMX kernel (None: where `prefill_amx` says it
    runs; False: the vector kernel, whose every query row is computed on its own in one fixed
    order). Eager only: no operator for compiled graphs."""
    q = q.contiguous()
    nq, kvh, gqa, d = q.shape
    k, v = k_pool, v_pool
    _check_pools("cpu_prefill_attention", q, k, v)
    n = q_starts.numel()
    if q_lens.numel() != n or kv_starts.numel() != n or kv_lens.numel() != n:
        raise ValueError("cpu_prefill_attention: one start and length of each kind a request")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype
                            or not out.is_contiguous()):  # fmt: skip
        raise ValueError("cpu_prefill_attention: out must be a contiguous tensor like q")
    indices, q_starts, q_lens = _i64(indices), _i64(q_starts), _i64(q_lens)
    kv_starts, kv_lens = _i64(kv_starts), _i64(kv_lens)
    if amx is None:
        amx = prefill_amx(q.dtype, d)
    kernel = "prefill_attention_{}_amx" if amx else "prefill_attention_{}"
    return _run(
        "cpu_prefill_attention", kernel, q, k, v, indices.data_ptr(),
        indices.numel(), q_starts.data_ptr(), q_lens.data_ptr(), kv_starts.data_ptr(),
        kv_lens.data_ptr(), n, nq, kvh, gqa, d, k.shape[0], k.stride(1), k.stride(0),
        v.stride(1), v.stride(0), window, out=out,
    )  # fmt: skip


def store_rows(pool: torch.Tensor, loc: torch.Tensor, x: torch.Tensor) -> None:
    """pool[loc] = x for a CPU KV pool [rows, KVH, D] and a step's [T, KVH, D] rows (each
    row's KVH x D block contiguous in both, any row stride; the same dtype): a C loop of row
    copies, 4-5x faster than index_put_; locations outside the pool raise ValueError, nothing
    written. Other layouts take index_put_. Eager only (a compiled graph fuses its own)."""
    lib = _library()
    assert lib is not None and pool.device.type == "cpu"
    kvh, d = pool.shape[1:]
    block = (x.dim() == 3 and x.shape[1:] == pool.shape[1:] and x.dtype == pool.dtype
             and x.stride(2) == 1 and x.stride(1) == d
             and pool.stride(2) == 1 and pool.stride(1) == d)  # fmt: skip
    if not block or loc.numel() != x.shape[0]:
        pool[loc] = x
        return
    loc = _i64(loc)
    size = x.element_size()
    rc = lib.kv_store(x.data_ptr(), x.stride(0) * size, pool.data_ptr(), pool.stride(0) * size,
                      loc.data_ptr(), loc.numel(), pool.shape[0], kvh * d * size,
                      torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise ValueError(f"store_rows: {_ERRORS.get(rc, rc)}")


def dequant_int4(codes: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 weights of int4 codes (uint8 [N, K / 2], the low nibble the even column) and
    bf16 scales and zeros [K / group, N, 2]: `(code - 8) * scale + zero` in fp32, rounded once
    to bf16, bit-identical to the same torch ops (`dequant.c`). `available(torch.bfloat16)`
    first; ValueError on other shapes or dtypes."""
    lib = _library()
    assert lib is not None
    n, half = codes.shape
    groups = scales_zeros.shape[0] if scales_zeros.dim() == 3 else 0
    if (codes.dtype != torch.uint8 or scales_zeros.dtype != torch.bfloat16 or groups < 1
            or scales_zeros.shape[1:] != (n, 2) or (2 * half) % groups):  # fmt: skip
        raise ValueError(f"dequant_int4: codes {tuple(codes.shape)} {codes.dtype} and scales "
                         f"{tuple(scales_zeros.shape)} {scales_zeros.dtype}: not a matching "
                         "shape of uint8 codes and bf16 [groups, N, 2]")  # fmt: skip
    codes, scales_zeros = codes.contiguous(), scales_zeros.contiguous()
    out = torch.empty(n, 2 * half, dtype=torch.bfloat16)
    rc = lib.dequant_int4_bf16(codes.data_ptr(), scales_zeros.data_ptr(), out.data_ptr(), n,
                               2 * half, 2 * half // groups, torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise ValueError(f"dequant_int4: {_ERRORS.get(rc, rc)} (shape)")
    return out


def dequant_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 weights of int8 ones [N, K] and bf16 scales [N]: `qweight * scales[:, None]`
    rounded once to bf16, bit-identical to torch's (`dequant.c`). `available(torch.bfloat16)`
    first; ValueError on other shapes or dtypes."""
    lib = _library()
    assert lib is not None
    if (qweight.dtype != torch.int8 or qweight.dim() != 2 or scales.dtype != torch.bfloat16
            or scales.shape != qweight.shape[:1]):  # fmt: skip
        raise ValueError(f"dequant_int8: weights {tuple(qweight.shape)} {qweight.dtype} and "
                         f"scales {tuple(scales.shape)} {scales.dtype}: not a matching shape of "
                         "int8 [N, K] and bf16 [N]")  # fmt: skip
    qweight, scales = qweight.contiguous(), scales.contiguous()
    n, k = qweight.shape
    out = torch.empty(n, k, dtype=torch.bfloat16)
    rc = lib.dequant_int8_bf16(qweight.data_ptr(), scales.data_ptr(), out.data_ptr(), n, k,
                               torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise ValueError(f"dequant_int8: {_ERRORS.get(rc, rc)} (shape)")
    return out


QUANT_KINDS = ("rows", "rmsnorm", "silu_mul")  # `quant.c`'s ROWS, RMSNORM, SILU_MUL


def quant_rows(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    in_scale: torch.Tensor | None,
    eps: float,
    kind: str,
    unsigned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [rows, n] and fp32 scales [rows, 1] of a bf16 [rows, n] matrix (rows
    contiguous, any row stride), the row formed by `kind` (`quant.c`): the row itself, its
    RMSNorm by the bf16 `weight` [n] and `eps`, or SiLU x up of its halves ([rows, 2n]) scaled
    by the fp32 `in_scale` [rows] (or 1). `unsigned`: the codes + 128 as uint8 (what oneDNN's
    VNNI GEMM takes), in the same pass. `available(torch.bfloat16)` first; the caller checks
    the shapes (`quantization.w8a8.quantize_input`)."""
    lib = _library()
    assert lib is not None and x.dtype == torch.bfloat16 and x.stride(-1) == 1
    rows, width = x.shape
    n = width // 2 if kind == "silu_mul" else width
    codes = torch.empty(rows, n, dtype=torch.uint8 if unsigned else torch.int8)
    scales = torch.empty(rows, 1, dtype=torch.float32)
    if in_scale is not None:
        in_scale = in_scale.to(torch.float32).contiguous()
    if weight is not None:
        weight = weight.contiguous()
    rc = lib.quant_rows_bf16(
        x.data_ptr(), x.stride(0), None if weight is None else weight.data_ptr(),
        None if in_scale is None else in_scale.data_ptr(), eps, QUANT_KINDS.index(kind),
        codes.data_ptr(), n, int(unsigned), scales.data_ptr(), rows, n, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"quant_rows: {_ERRORS.get(rc, rc)}")
    return codes, scales


def elementwise(x: torch.Tensor) -> bool:
    """Whether the C elementwise ops (`scale_rows_`, `rope`, u8 codes from `quant_rows`) take
    x's step: a bf16 CPU tensor, the kernels built, outside a graph torch.compile traces (there
    inductor fuses the torch expressions). Their results are the torch ops' to the bit."""
    if torch.compiler.is_compiling():  # first: dynamo folds it, and traces nothing after
        return False
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and _library() is not None


def scale_rows_(y: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """y [rows, n] bf16 (rows contiguous, any row stride) times the fp32 scale of its row
    (s: [rows] or [rows, 1]), in place: `(y.float() * s).to(torch.bfloat16)` to the bit, one
    pass (`prefill_ops.c`). Returns y."""
    lib = _library()
    assert lib is not None
    if y.dtype != torch.bfloat16 or y.dim() != 2:
        raise ValueError(f"scale_rows_: y must be a bf16 matrix, got {y.dtype} {tuple(y.shape)}")
    if y.stride(-1) != 1:
        raise ValueError("scale_rows_: y's rows must be contiguous")
    rows, n = y.shape
    if s.numel() != rows:
        raise ValueError(f"scale_rows_: {rows} rows need {rows} scales, got {s.numel()}")
    s = s.to(torch.float32).contiguous()
    if rows and n:
        rc = lib.scale_rows_bf16(y.data_ptr(), y.stride(0), s.data_ptr(), rows, n,
                                 torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"scale_rows_: {_ERRORS.get(rc, rc)}")
    return y


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q [T, H, D] and k [T, KVH, D] (bf16, heads contiguous, tokens any stride apart:
    the QKV GEMM's views) at cos / sin [T, D] (the model's signed sin table's rows): new q and k,
    each head h -> h * cos + swap_halves(h) * sin as `models.layers.apply_rope`'s torch ops
    give it, to the bit, in one pass (`prefill_ops.c`)."""
    lib = _library()
    assert lib is not None
    t, nh, d = q.shape
    kvh = k.shape[1]
    if any(x.dtype != torch.bfloat16 for x in (q, k, cos, sin)):
        raise ValueError("rope: q, k, cos and sin must be bf16")
    if k.shape != (t, kvh, d) or cos.shape != (t, d) or sin.shape != (t, d) or d % 2:
        raise ValueError(f"rope: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, cos "
                         f"{tuple(cos.shape)}, sin {tuple(sin.shape)}")  # fmt: skip
    if q.stride()[1:] != (d, 1) or k.stride()[1:] != (d, 1):
        raise ValueError("rope: each token's heads must be contiguous")
    cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty(t, nh, d, dtype=q.dtype)
    ko = torch.empty(t, kvh, d, dtype=k.dtype)
    if t:
        rc = lib.rope_bf16(q.data_ptr(), q.stride(0), nh, k.data_ptr(), k.stride(0), kvh,
                           cos.data_ptr(), sin.data_ptr(), qo.data_ptr(), ko.data_ptr(), t, d,
                           torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"rope: {_ERRORS.get(rc, rc)}")
    return qo, ko


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.max(dim=-1)` (values, int64 indices) of a CPU [rows, n] fp32 / bf16 matrix whose rows
    are contiguous: the same values and indices (first maximum; a row with a NaN gives its
    first NaN), 2-4x faster than torch's bf16 reduction here ([128, 49152]: 2.1 ms hot, 3.6 ms
    in a decode step). `available(x.dtype)` first."""
    lib = _library()
    assert lib is not None and x.device.type == "cpu" and x.dim() == 2
    if x.stride(-1) != 1 or x.shape[-1] < 1:
        return x.max(dim=-1)
    rows, n = x.shape
    values = x.new_empty(rows)
    indices = torch.empty(rows, dtype=torch.int64)
    fn = getattr(lib, f"row_max_{_DTYPES[x.dtype]}")
    rc = fn(x.data_ptr(), values.data_ptr(), indices.data_ptr(), rows, n, x.stride(0),
            torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise ValueError(f"row_max: {_ERRORS.get(rc, rc)}")
    return values, indices


def _like_q(q: torch.Tensor, *rest: Any) -> torch.Tensor:
    """Both kernels' output on the Meta device: q's shape and dtype, contiguous."""
    return torch.empty_like(q, memory_format=torch.contiguous_format)


define_op(
    "cpu_decode_attention(Tensor q, Tensor k, Tensor v, Tensor lens, int window) -> Tensor",
    cpu=_decode_attention,
    meta=_like_q,
)
define_op(
    "cpu_paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor indices, "
    "Tensor indptr, Tensor lens, int window) -> Tensor",
    cpu=_paged_decode_attention,
    meta=_like_q,
)
