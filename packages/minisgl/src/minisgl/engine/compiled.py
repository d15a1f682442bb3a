"""Decode steps through one `torch.compile`d forward (`enable_torch_compile`, card P2-002).

On a CPU a decode step of a small model is bound by dispatch, not by its weights: ~1,500 small
ops and the Python between them cost more than the int4 matmuls of a token. Inductor fuses the
elementwise ops into a few C++ loops and calls the matmuls and SDPA directly:
- weights are frozen (constants of the graph): inductor may prepack them, and with
  `max_autotune` picks its CPP weight-only int4 GEMM template where it beats ATen's kernel
  (measured per shape at compile time, cached on disk);
- shapes are dynamic (batch size and KV length change every step), so a handful of graphs
  serve every decode step: one per key (batch 1 or more, `AttentionBackend.graph_key`: the
  torch-native backend's decode mode: paged through the CPU kernel, or its SDPA workspace
  rebuilding or appending);
- each key compiles its own copy of the code object that calls the model. Dynamo keeps its
  compiled entries on the code object and checks them in turn, newest first: with one shared
  cache, a batch-1 step first checked the guards of the batch-2 graphs. Own code objects also
  keep the models of one process apart (another size, another quantization), which the guards
  could not tell apart, because
- guards on module attributes are skipped: the weights never change after load, and checking
  ~400 tensors per call cost ~0.7 ms a step. Guards on the step's own inputs (shapes, the
  attention metadata) stay; the KV pool's tensors are static (dynamic, each of its 2 x layers
  tensors added symbolic-shape guards, evaluated in Python every step);
- the graphs write the KV pool (and SDPA's decode workspace) in place, by index_put_ on the
  graph's input tensors: a write through a view of an input is functionalized into a scatter of the
  whole tensor (`attention/torch_native.py`).
- quantized layers change kernels at row counts of their own (`row_thresholds`: the packed
  kernel below, one GEMM on de-quantized weights from there on), a check that is a guard: the
  graphs are keyed by the class of the row count too (`row_bounds`), so each graph sees one
  side of every threshold, and the start compiles one graph per class. A bf16 int8 model on
  an AMX CPU keeps the packed kernel at every count here (`frozen_graphs`): inductor's AMX
  template reads the frozen int8 weights.
A decode step the attention backend does not mark `compiles` runs eager (torch-native through
SDPA: a batch over the decode workspace budget, which gathers its KV every step).

Prefill runs piecewise (`CompiledPrefill`, CPU only): each layer's two pieces around attention
(`DecoderLayer.pre_attention`: norm, QKV, RoPE; `post_attention`: o_proj, residual, norm, MLP)
are compiled with the token count dynamic (one pair of graphs per row class of a quantized
model: dynamo keeps both in the pieces' cache), and attention stays eager (its per-request groups
and masks change with every step's mix of lengths). The pieces take the layer as an input,
module guards skipped, and are not frozen: the weights are graph inputs, so one pair of graphs
serves every layer (the layers of a model are alike) and every length (a one-token prefill
runs eager: a count of 1 would specialise). Measured on many-short's 4096-token step (bf16, 2
threads, AMX): 1.85 -> 0.86-1.06 s, the eager norms, RoPE, SiLU and casts having taken ~0.9 s
beside ~0.43 s of GEMMs.
`LLM` compiles all the graphs at start (`Runtime.warm_up`), so serving never stalls on a
compile.

The compiled forward must not run under `inference_mode` (AOT autograd cannot view inference
tensors): the engine runs its steps under `no_grad` when compile is on.
"""

from __future__ import annotations

import functools
import types
from bisect import bisect_right
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx.experimental._config as fx_config

from minisgl.quantization.linear import DEQUANT_OPS, Int4Linear, Int8Linear, frozen_graphs
from minisgl.quantization.w8a8 import W8A8Linear
from minisgl.utils.log import get_logger

if TYPE_CHECKING:
    from minisgl.attention.base import AttentionBackend

logger = get_logger(__name__)

QUANTIZED = (Int4Linear, Int8Linear, W8A8Linear)


def row_bounds(model: torch.nn.Module) -> tuple[int, ...]:
    """The row counts at which a quantized layer of `model` changes kernels, sorted: the
    bounds of the row classes its graphs are keyed by."""
    rows = {r for m in model.modules() if isinstance(m, QUANTIZED) for r in m.row_thresholds}
    return tuple(sorted(rows))


def class_starts(bounds: tuple[int, ...], first: int) -> list[int]:
    """The smallest row count of each class from `first` rows on."""
    return [first, *(b for b in bounds if b > first)]


def _packed(layer: torch.nn.Module, rows: int) -> bool:
    """Whether a decode graph for `rows` rows and up runs `layer` on its packed weights."""
    if not isinstance(layer, QUANTIZED):
        return False
    return layer.packed_when_frozen or rows < max(layer.row_thresholds, default=0)


def _options(model: torch.nn.Module, device: torch.device, rows: int) -> dict[str, Any]:
    """Options of a decode graph for `rows` rows and up. Autotune GEMMs only where it pays:
    packed weight-only quantized linears on a CPU (the int4 template: 80 -> 117 tok/s single
    stream on the embedded model, 2 threads; the int8 one at batch, see
    `quantization.linear.frozen_graphs`); float GEMMs (de-quantized weights included) would
    only add compile time (every shape's CPP template is built and timed)."""
    options: dict[str, Any] = {
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
    }
    if device.type == "cpu" and any(_packed(m, rows) for m in model.modules()):
        # ATen stays a choice: the kernel of a shape the template refuses (at 32 rows the
        # template timed 8-14x faster than ATen's packed GEMV for every int8 shape here)
        options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    return options


@functools.cache
def _keep_dequantization_in_graphs() -> None:
    """Freezing folds whatever reads constants only: the de-quantized weights would become
    float constants of the graph, a second copy of every weight."""
    from torch._inductor.constant_folding import add_dont_constant_fold

    for op in DEQUANT_OPS:
        add_dont_constant_fold(op)


# read outside the inductor options of `torch.compile` (AOT autograd decides what is a
# constant): patched around each call, as a compile can happen at any call (a new shape class)
_FREEZING = {"freezing": True}
# no duck shapes: a batch of 2 would otherwise be compiled as "batch == the KV head count"
# (both 2) and the first batch of another size would compile again
_SHAPES = {"use_duck_shape": False}


class CompiledDecode:
    """The model's forward compiled for decode steps, one graph per key; `steps` counts the
    calls, `graphs` maps each key (the batch's kind: 1 for batch 1, 2 + its row class for
    more; the backend's key) to its compiled function."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        static: tuple[torch.Tensor, ...] = (),
    ) -> None:
        """`static`: tensors a step reads whose shapes never change (the KV pool's): their
        shapes are constants of the graph, not symbols with guards checked every step."""
        for t in static:
            torch._dynamo.mark_static(t)
        _keep_dequantization_in_graphs()
        self.model = model
        self.device = device
        self.bounds = row_bounds(model)
        self.graphs: dict[tuple[int, Hashable], Callable[..., torch.Tensor]] = {}
        self.steps = 0
        logger.info("decode steps run through torch.compile (compiled on first use)")

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        backend: AttentionBackend,
        meta: Any,
    ) -> torch.Tensor:
        bs = input_ids.shape[0]
        row_class = bisect_right(self.bounds, bs)
        key = (1 if bs == 1 else 2 + row_class, backend.graph_key(meta))
        fn = self.graphs.get(key)
        if fn is None:
            rows = bs if bs == 1 else max((2, *self.bounds[:row_class]))
            options = _options(self.model, self.device, rows)
            fn = torch.compile(_own_call(self.model), dynamic=True, options=options)
            self.graphs[key] = fn
            if bs > 1:
                # the batch this graph is compiled (and autotuned) at, in the FX graph cache's
                # key (a hint is not otherwise): the classes of a bf16 int8 model on AMX trace
                # one graph (the packed kernel at every count), and a class served another's
                # artifact ran GEMMs autotuned at the other's row count (ATen's GEMV at 2 rows:
                # many-short's batch-128 step 37 -> 161 ms)
                torch._dynamo.mark_dynamic(input_ids, 0, hint_override=bs)
        self.steps += 1
        with torch._inductor.config.patch(_FREEZING), fx_config.patch(_SHAPES), frozen_graphs():
            return fn(input_ids, positions, logits_indices, backend, meta)

    def compile_batches(self, max_batch: int) -> list[int]:
        """A batch size of each key's row part (batch 1, then each class from 2 rows), up to
        `max_batch`: what the start runs to compile every graph."""
        return [1, *(b for b in class_starts(self.bounds, 2) if b <= max_batch)]


def _own_call(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """`model(*args)` behind a fresh code object: a dynamo cache of its own. The module is
    called (not its bound `forward`), so dynamo sees its parameters as parameters and
    freezing can fold them into the graph."""

    def decode(*args: Any) -> torch.Tensor:
        return model(*args)

    return _own_code(decode)


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` behind a copy of its code object: dynamo keeps its compiled entries on the code
    object, and with module guards skipped the graphs of another model (another
    architecture: no q / k norms) would otherwise pass the guards of this one."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)  # fmt: skip


# a one-token prefill would specialise the dynamic token count (0 / 1 specialisation)
PREFILL_MIN_TOKENS = 2
# the token count of the prefill that compiles the pieces (`Runtime.warm_up`): inductor
# generates the code for that size hint. Compiled at 8 tokens, many-short's 4096-token step
# took 1.30-1.44 s, compiled at 1024 1.08-1.23 s (bf16, 2 threads)
PREFILL_HINT_TOKENS = 1024


class CompiledPrefill:
    """A prefill step's layers as two compiled pieces each around eager attention (see the
    module docstring); used as `model(..., run_layer=compiled_prefill)`. `steps` counts the
    steps run through it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.bounds = row_bounds(model)
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        # each its own options dict: torch.compile pops `guard_filter_fn` out of it
        # own code objects: a cache of this model's graphs only (see `_own_code`)
        pre, post = _own_code(_pre_attention), _own_code(_post_attention)
        self.pre = torch.compile(pre, dynamic=True, options=dict(options))
        self.post = torch.compile(post, dynamic=True, options=dict(options))
        self.steps = 0
        logger.info("prefill layers run through torch.compile, piecewise around attention")

    def runs(self, num_tokens: int) -> bool:
        return num_tokens >= PREFILL_MIN_TOKENS

    def compile_lengths(self, max_tokens: int) -> list[int]:
        """A token count of each row class up to `max_tokens` (a step's budget): what the start
        runs to compile every pair of pieces. Each is as close to `PREFILL_HINT_TOKENS` as its
        class allows (inductor generates the code for that size hint)."""
        starts = class_starts(self.bounds, PREFILL_MIN_TOKENS)
        lengths = []
        for lo, hi in zip(starts, [*starts[1:], None], strict=True):
            n = max(lo, PREFILL_HINT_TOKENS if hi is None else min(hi - 1, PREFILL_HINT_TOKENS))
            if lo <= max_tokens:
                lengths.append(min(n, max_tokens))
        return lengths

    def __call__(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        meta: Any,
    ) -> torch.Tensor:
        if layer.self_attn.layer_id == 0:
            self.steps += 1
        with fx_config.patch(_SHAPES):
            return layer.around_attention(x, cos_sin, backend, meta, self.pre, self.post)


def _pre_attention(layer: Any, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
    return layer.pre_attention(x, cos_sin)


def _post_attention(layer: Any, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    return layer.post_attention(x, attn)
