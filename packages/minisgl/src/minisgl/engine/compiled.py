"""Decode steps through one `torch.compile`d forward (`enable_torch_compile`, card P2-002).

On a CPU a decode step of a small model is bound by dispatch, not by its weights: ~1,500 small
ops and the Python between them cost more than the int4 matmuls of a token. Inductor fuses the
elementwise ops into a few C++ loops and calls the matmuls and SDPA directly:
- weights are frozen (constants of the graph): inductor may prepack them, and with
  `max_autotune` picks its CPP weight-only int4 GEMM template where it beats ATen's kernel
  (measured per shape at compile time, cached on disk);
- shapes are dynamic (batch size and KV length change every step; batch size 1 gets its own
  specialised graph), so a handful of graphs serve every decode step;
- guards on module attributes are skipped: the weights never change after load, and
  checking ~400 tensors per call cost ~0.7 ms a step. Guards on the step's own inputs (shapes,
  the attention metadata) stay. Dynamo keeps its compiled entries on the code object, which
  every model instance shares: without those guards a second model (another size, another
  quantization) would run the first one's graph, so each `CompiledDecode` compiles its own
  copy of `forward`'s code object.
Prefill stays eager: its shapes vary too much to pay for a compile, and it is GEMM-bound.

The compiled forward must not run under `inference_mode` (AOT autograd cannot view inference
tensors): the engine runs its steps under `no_grad` when compile is on.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from minisgl.utils.log import get_logger

logger = get_logger(__name__)


def _options(device: torch.device) -> dict[str, Any]:
    options: dict[str, Any] = {
        "freezing": True,
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
    }
    if device.type == "cpu":
        options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    return options


class CompiledDecode:
    """The model's forward compiled for decode steps; `steps` counts the calls."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        forward = _own_code(model.forward)
        self.fn = torch.compile(forward, dynamic=True, options=_options(device))
        self.steps = 0
        logger.info("decode steps run through torch.compile (compiled on first use)")

    def __call__(self, *args: Any) -> torch.Tensor:
        self.steps += 1
        return self.fn(*args)


def _own_code(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` bound to a fresh copy of its function's code object: a cache of its own."""
    fn = method.__func__  # type: ignore[attr-defined]
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)  # fmt: skip
    copy.__kwdefaults__ = fn.__kwdefaults__
    return types.MethodType(copy, method.__self__)  # type: ignore[attr-defined]
