"""Decode steps through one `torch.compile`d forward (`enable_torch_compile`, card P2-002).

On a CPU a decode step of a small model is bound by dispatch, not by its weights: ~1,500 small
ops and the Python between them cost more than the int4 matmuls of a token. Inductor fuses the
elementwise ops into a few C++ loops and calls the matmuls and SDPA directly:
- weights are frozen (constants of the graph): inductor may prepack them, and with
  `max_autotune` picks its CPP weight-only int4 GEMM template where it beats ATen's kernel
  (measured per shape at compile time, cached on disk);
- shapes are dynamic (batch size and KV length change every step), so a handful of graphs
  serve every decode step: one per key (batch 1 or more, `AttentionBackend.graph_key`: the
  torch-native workspace rebuilding or appending);
- each key compiles its own copy of the code object that calls the model. Dynamo keeps its
  compiled entries on the code object and checks them in turn, newest first: with one shared
  cache, a batch-1 step first checked the guards of the batch-2 graphs. Own code objects also
  keep the models of one process apart (another size, another quantization), which the guards
  could not tell apart, because
- guards on module attributes are skipped: the weights never change after load, and checking
  ~400 tensors per call cost ~0.7 ms a step. Guards on the step's own inputs (shapes, the
  attention metadata) stay; the KV pool's tensors are static (dynamic, each of its 2 x layers
  tensors added symbolic-shape guards, evaluated in Python every step);
- the graphs write the KV pool and the decode workspace in place, by index_put_ on the graph's
  input tensors: a write through a view of an input is functionalized into a scatter of the
  whole tensor (`attention/torch_native.py`).
Prefill stays eager: its shapes vary too much to pay for a compile, and it is GEMM-bound; so
does a decode step the attention backend does not mark `compiles` (torch-native: a batch over
the decode workspace budget, which gathers its KV every step). `LLM` compiles the graphs at
start (`LLM._compile_decode`), so serving never stalls on a compile.

The compiled forward must not run under `inference_mode` (AOT autograd cannot view inference
tensors): the engine runs its steps under `no_grad` when compile is on.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx.experimental._config as fx_config

from minisgl.quantization.linear import Int4Linear, Int8Linear
from minisgl.utils.log import get_logger

if TYPE_CHECKING:
    from minisgl.attention.base import AttentionBackend

logger = get_logger(__name__)

QUANTIZED = (Int4Linear, Int8Linear)


def _options(model: torch.nn.Module, device: torch.device) -> dict[str, Any]:
    """Autotune GEMMs only where it pays: weight-only quantized linears on a CPU (the int4
    template: 80 -> 117 tok/s single stream on the embedded model, 2 threads); float GEMMs
    would only add compile time (every shape's CPP template is built and timed)."""
    options: dict[str, Any] = {
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
    }
    if device.type == "cpu" and any(isinstance(m, QUANTIZED) for m in model.modules()):
        options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    return options


# read outside the inductor options of `torch.compile` (AOT autograd decides what is a
# constant): patched around each call, as a compile can happen at any call (a new shape class)
_FREEZING = {"freezing": True}
# no duck shapes: a batch of 2 would otherwise be compiled as "batch == the KV head count"
# (both 2) and the first batch of another size would compile again
_SHAPES = {"use_duck_shape": False}


class CompiledDecode:
    """The model's forward compiled for decode steps, one graph per key; `steps` counts the
    calls, `graphs` maps each key (1 or 2 for batch 1 or more, the backend's key) to its
    compiled function."""

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
        self.model = model
        self.options = _options(model, device)
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
        key = (min(input_ids.shape[0], 2), backend.graph_key(meta))
        fn = self.graphs.get(key)
        if fn is None:
            # a copy: torch.compile pops `guard_filter_fn` out of the dict it is given
            fn = torch.compile(_own_call(self.model), dynamic=True, options=dict(self.options))
            self.graphs[key] = fn
        self.steps += 1
        with torch._inductor.config.patch(_FREEZING), fx_config.patch(_SHAPES):
            return fn(input_ids, positions, logits_indices, backend, meta)


def _own_call(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """`model(*args)` behind a fresh code object: a dynamo cache of its own. The module is
    called (not its bound `forward`), so dynamo sees its parameters as parameters and
    freezing can fold them into the graph."""

    def decode(*args: Any) -> torch.Tensor:
        return model(*args)

    return types.FunctionType(decode.__code__.replace(), decode.__globals__, decode.__name__,
                              decode.__defaults__, decode.__closure__)  # fmt: skip
