"""Kernel launches of a piece of code, counted without a GPU.

Two sources, as a CUDA run would launch them: the ATen ops that run a kernel (seen by a
`TorchDispatchMode`; views, allocations and other metadata-only ops launch none), and each
Triton launch (`kernel[grid](...)`, hooked where triton runs it, compiled or interpreted). The
torch ops a launch itself runs (the interpreter's copies of its arguments) are not counted.
Measured on CPU tensors the ATen ops are those the same code dispatches on CUDA: the models
run the same calls on both devices, so the count is the CUDA path's (cuBLAS may split a GEMM
with a bias into two kernels: counted as one op).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# ops that are not views but run no kernel: allocations and metadata
NO_KERNEL = {
    _aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty,
    _aten.new_empty_strided, _aten._unsafe_view, _aten.lift_fresh, _aten.set_,
    _aten.resize_, _aten.sym_size, _aten.sym_stride, _aten.sym_numel, _aten.sym_storage_offset,
}  # fmt: skip


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    return not func.is_view and func.overloadpacket not in NO_KERNEL


class LaunchCounter(TorchDispatchMode):
    """`counts`: launches by name (`aten.<op>` or `triton:<kernel>`); `total`: their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.paused = False

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and launches_kernel(func):
            self.counts[f"aten.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))

    def triton_launch(self, name: str, run: Callable[[], Any]) -> Any:
        if self.paused:
            return run()
        self.counts[f"triton:{name}"] += 1
        self.paused = True
        try:
            return run()
        finally:
            self.paused = False


@contextmanager
def count_launches() -> Iterator[LaunchCounter]:
    """`with count_launches() as c: ...`: the kernel launches of the block in `c`."""
    counter = LaunchCounter()
    patched = []
    for cls in _launcher_classes():
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            name = getattr(self, "__name__", None) or self.fn.__name__
            return counter.triton_launch(name, lambda: _original(self, *args, **kwargs))

        cls.run = run
        patched.append((cls, original))
    try:
        with counter:
            yield counter
    finally:
        for cls, original in patched:
            cls.run = original


def _launcher_classes() -> list[type]:
    """Triton's kernel classes whose `run` is a launch (none if triton is not installed)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    return [JITFunction, InterpretedFunction]


# issue 36: launches a decode layer may take (Qwen3 adds its q/k norms)
LAYER_BUDGET = {"llama": 12, "qwen2": 12, "mistral": 12, "qwen3": 14}


@dataclass(frozen=True)
class LayerLaunches:
    """One decode layer's launches: a 2-layer model's decode step minus a 1-layer one's (the
    embedding, final norm and lm_head cancel)."""

    arch: str
    fused: bool  # through the fused Triton ops (else the torch ops)
    per_layer: int
    by_kernel: dict[str, int]  # the layer's launches by name (`aten.<op>`, `triton:<kernel>`)
    step_total: int  # the 2-layer step's launches

    @property
    def balanced(self) -> bool:
        """Every launch of the layer is one more with two layers (none fewer)."""
        return sum(self.by_kernel.values()) == self.per_layer


def decode_layer_launches(arch: str, fused: bool, workdir: str | Path) -> LayerLaunches:
    """Launches of one decode layer of a tiny `arch` model (fp32, triton attention, no graphs).
    On a CPU the fused ops run only in Triton's interpreter (`TRITON_INTERPRET=1` set before
    triton is first imported)."""
    import torch

    from minisgl.config import EngineConfig
    from minisgl.engine.engine import Engine
    from minisgl.testing.plans import GreedyRow, PlannedBatch
    from minisgl.testing.tiny_models import write_tiny_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    counters = []
    old = os.environ.get("MINISGL_FUSED_OPS")
    os.environ["MINISGL_FUSED_OPS"] = "on" if fused else "off"
    try:
        for layers in (1, 2):
            path = write_tiny_model(arch, Path(workdir) / f"{arch}-{layers}", seed=0,
                                    num_hidden_layers=layers)  # fmt: skip
            engine = Engine(EngineConfig(
                model_path=str(path), device=device, dtype="float32", attention_backend="triton",
                num_pages=256, max_seq_len_override=128, graph_runner="none"))  # fmt: skip
            batch = PlannedBatch.for_engine(engine, [7, 3, 11], 32)
            rows = [GreedyRow()] * 3
            batch.push(engine.sample_step(batch.plan(True), rows, frozenset()).tokens)
            plan = batch.plan(False)
            with count_launches() as counter:
                engine.forward(plan)
            counters.append(counter)
    finally:
        if old is None:
            os.environ.pop("MINISGL_FUSED_OPS", None)
        else:
            os.environ["MINISGL_FUSED_OPS"] = old
    one, two = counters
    return LayerLaunches(arch, fused, two.total - one.total, dict(two.counts - one.counts),
                         two.total)  # fmt: skip
