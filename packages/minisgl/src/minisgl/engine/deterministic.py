"""Deterministic mode (`EngineConfig.deterministic`, `LLM(deterministic=True)`, the server's
`--deterministic`): batch-invariant kernels on a CPU, so a request's logits, hence its tokens
for its seed (the sampler's noise is keyed per request already), do not depend on what else
runs in its steps: other requests batched beside it, how its prompt was chunked, whether its
prefix came from the cache.

What varies with the batch outside this mode, and what the mode does instead:
- bf16 `F.linear` (oneDNN) picks its kernel by row count: M = 1 differs from M >= 2 (e.g.
  the lm_head's 49152 features), and on a CPU with AMX (intel-amx) M >= 33 runs the AMX tile
  kernel, whose sums round differently from the AVX-512 kernel of 2 <= M <= 32 (most layers
  of the embedded model from 33 rows; without AMX every M >= 2 agreed; oneDNN's AMX kernel
  also gives a row other bits at other offsets and row counts). On a CPU with AMX-BF16 every
  linear runs this project's AMX GEMM instead (`kernels/cpu/amx_gemm.c`): rows in tiles of
  16, a short tile zero-padded, each output's sum over k in one order from zero, so a row's
  bits are its own at every row count and offset (as fast as oneDNN's AMX kernel from 16 rows
  on the embedded model's shapes, faster at 16-64). Elsewhere oneDNN's rows 2..32 agree with
  each other, row by row, at every row offset, and without AMX tiles so did every count
  probed (amd-epyc): a linear runs its rows in blocks of at most `row_block` rows, 256 where a
  probe at load finds every row count up to it giving a row the same bits, else 32, a
  one-row block as two rows (the row twice), its first row kept.
- Quantized layers switch kernels by row count (the packed int4 / int8 kernel below
  `dequant_min_rows`, the de-quantized GEMM above): here every row count multiplies weights
  de-quantized once at load (a bf16 copy of every quantized layer beside its codes: the
  memory of the float model) through the GEMM above. W8A8 (per-row int8 activations, another
  kernel) is refused.
- Decode steps of an int4 model run the one-call C decode step (`engine/cpu_decode.py`), made
  batch-invariant: its int4 GEMM runs one row through the multi-row tiles too (whose per-row
  arithmetic and reduction order do not depend on the other rows), and every decode step runs
  there, however many rows. Its numbers differ from the prefill path's (int8 activations), so
  a decode step's K / V are not what a prefill of the same tokens writes: the prefix cache
  holds prompts only (`SchedulerConfig.cache_outputs` off, the Rust service's
  `--no-cache-outputs`), and a prompt that extends an earlier answer is prefilled, as alone on
  a fresh engine. Other models decode through the modules below. The decode graphs (`replay`)
  are off and compiled graphs refused (inductor picks its own kernels per shape).
- Attention: a prefill step picks SDPA, the vector C kernel or the AMX kernel by request
  length, and decode its own split kernel. Here every prefill step, and every decode step the
  C decode step does not run (its paged decode attention: one task a request and KV head),
  attends through the vector C kernel (`prefill_attention.c`): a query's scores, softmax tiles (anchored at
  absolute key positions) and weighted sum are its own row's, in one fixed order, whatever the
  other query rows of the call, however the KV was split between the cache and the step.
- fp32 `F.linear` (MKL) is batch-variant at every row count (M = 1, 2, 3, 7... differ for the
  same row): fp32 is refused, as are CUDA (out of scope: its kernels are not made invariant),
  tensor parallelism and a CPU without native bf16 (its int4 layers widen to an fp32 GEMM).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minisgl.kernels import cpu as cpu_native
from minisgl.kernels.cpu import amx_gemm
from minisgl.quantization.linear import Int4Linear, Int8Linear
from minisgl.utils.cpu import native_bf16

HOW = "deterministic mode"


def check(config, device: torch.device, dtype: torch.dtype, quantization: str) -> None:
    """A ValueError naming why the engine cannot run batch-invariant as configured."""
    why = None
    if device.type != "cpu":
        why = (f"it runs on a CPU only (device {device.type!r}: the GPU kernels are not "
               "batch-invariant)")  # fmt: skip
    elif dtype != torch.bfloat16:
        why = (f"it needs bfloat16 (got {str(dtype).replace('torch.', '')}: fp32 GEMMs give a "
               "row different bits at different batch sizes); pass dtype='bfloat16'")  # fmt: skip
    elif not native_bf16():
        why = "it needs a CPU with native bf16 (AVX512-BF16 or AMX)"
    elif not cpu_native.available(dtype):
        why = "it needs the C kernels (kernels/cpu: a C compiler)"
    elif quantization == "w8a8":
        why = "w8a8 quantization is not supported (its int8 GEMM is batch-variant)"
    elif config.enable_torch_compile:
        why = "enable_torch_compile is not supported"
    elif config.tp_size > 1:
        why = "tensor parallelism is not supported"
    elif config.attention_backend not in ("auto", "torch_native"):
        why = f"attention_backend {config.attention_backend!r} is not supported"
    elif config.graph_runner not in ("auto", "none"):
        why = f"graph_runner {config.graph_runner!r} is not supported"
    if why is not None:
        raise ValueError(f"{HOW}: {why}")


def make_batch_invariant(model: nn.Module) -> int:
    """Make every linear layer of `model` batch-invariant (one kernel path for every row count:
    the AMX GEMM where the CPU has AMX-BF16, else oneDNN's in blocks of 2..`row_block` rows,
    one row padded to two); returns how many layers."""
    count = 0
    blocks: dict[tuple, int] = {}
    for m in model.modules():
        quantized = isinstance(m, (Int4Linear, Int8Linear))
        if not quantized and not isinstance(m, nn.Linear):
            continue
        # quantized: de-quantized once, here (the same bits the layer's every call made; a pass
        # over its codes a call was ~45% of a step), kept in the activation dtype
        weight = m.dequantize() if quantized else m.weight
        if amx_gemm.supported() and weight.dtype == torch.bfloat16 and weight.shape[1] % 32 == 0:
            m.forward = _AmxRows(amx_gemm.AmxWeight.of(weight, m.bias))
            if (
                not quantized
            ):  # the packed copy is the layer's only one (a tied module keeps its own)
                m.weight = nn.Parameter(weight.new_empty(0, weight.shape[1]), requires_grad=False)
        else:
            if quantized:
                m.dequant_min_rows = 1
                m.dequantize = _Dequantized(weight)
            key = (type(m), tuple(weight.shape), weight.dtype, getattr(m, "bias", None) is None)
            if key not in blocks:  # one probe a kind of layer (the model's ~5 shapes)
                blocks[key] = row_block(m.forward, weight.shape[1], weight.dtype)
            m.forward = RowBlocks(m.forward, blocks[key])
        count += 1
    return count


class _AmxRows:
    """A linear's forward through the AMX GEMM (a row's bits its own at every row count)."""

    def __init__(self, weight: amx_gemm.AmxWeight) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.bfloat16 or rows.stride(-1) != 1:
            rows = rows.to(torch.bfloat16).contiguous()
        y = amx_gemm.amx_gemm(rows, self.weight)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.weight.n)


class _Dequantized:
    """A quantized layer's `dequantize(rows)`: rows of its weights de-quantized at load."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, rows: slice = slice(None)) -> torch.Tensor:
        return self.weight[rows]


# the most rows one GEMM call of a linear gets: oneDNN's bf16 GEMM runs 2..32 rows on its
# AVX-512 kernel (the same bits for a row whatever the others) and more on AMX tiles where the
# CPU has them (other bits); without AMX its rows agreed at every count (amd-epyc), where one
# call of 256 rows ran the embedded model's prefill linears 1.4-1.8x faster than 8 of 32
ROW_BLOCK = 32
WIDE_ROW_BLOCK = 256
# the row counts and offsets `row_block` compares, on rows drawn from a fixed seed
PROBE_ROWS = (2, 3, 17, 32, 33, 64, 129, 256)
PROBE_OFFSETS = (0, 5)


def row_block(forward: Callable[[torch.Tensor], torch.Tensor], k: int, dtype: torch.dtype) -> int:
    """The widest row block a linear's `forward` (rows [m, k] of `dtype`) may run in
    deterministic mode: `WIDE_ROW_BLOCK` where each probed row count (`PROBE_ROWS`, at
    `PROBE_OFFSETS`) gives every row the bits blocks of `ROW_BLOCK` give it, else `ROW_BLOCK`
    where the counts up to it agree; a ValueError where even those differ (no block keeps a
    row's bits its own). A probe, not a proof: the tests check the mode's promise end to end."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(PROBE_ROWS) + max(PROBE_OFFSETS), k, generator=g).to(dtype)
    with torch.inference_mode():
        base = torch.cat([forward(x[s : s + ROW_BLOCK]) for s in range(0, len(x), ROW_BLOCK)])
        same = {
            m: all(torch.equal(forward(x[o : o + m]), base[o : o + m]) for o in PROBE_OFFSETS)
            for m in PROBE_ROWS
        }
    for limit in (WIDE_ROW_BLOCK, ROW_BLOCK):
        if all(ok for m, ok in same.items() if m <= limit):
            return limit
    raise ValueError(
        f"{HOW}: this CPU's GEMM gives a row other bits at another row count (a [{k}]-input "
        "linear, rows 2..32), so no row block keeps a request's logits its own"
    )


class RowBlocks:
    """A linear's forward run on blocks of 2..`block` rows (`row_block`: the widest whose row
    counts agree), a one-row block run as two rows (oneDNN's one-row bf16 GEMM differs from its
    kernels of more rows, which agree with each other row by row)."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], block: int) -> None:
        self.forward, self.block = forward, block

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            if x.dim() < 2:
                return self.forward(x)
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        m, b = x.shape[0], self.block
        if m <= b:
            return self._block(x)
        return torch.cat([self._block(x[s : s + b]) for s in range(0, m, b)])

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return self.forward(x.expand(2, -1).contiguous())[:1]
        return self.forward(x)
