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

    def hook(kernel: Any, run: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
        return counter.triton_launch(_kernel_name(kernel), run)

    with _hooked_launches(hook), counter:
        yield counter


@dataclass(frozen=True)
class KernelVariant:
    """One compiled form of a Triton kernel: what Triton keys its JIT cache on at a launch
    (each argument's type and specialisation, each constexpr's value, the launch options). A
    variant a process has not met before is compiled at that launch (hundreds of ms on a
    GPU: every running request waits)."""

    kernel: str
    key: tuple[tuple[str, str], ...]


class VariantRecorder:
    """`variants`: the distinct `KernelVariant`s launched; `launches`: how many launches."""

    def __init__(self) -> None:
        self.variants: set[KernelVariant] = set()
        self.launches = 0

    def describe(self, variants: set[KernelVariant]) -> str:
        return "\n".join(f"{v.kernel}: {dict(v.key)}" for v in sorted(variants, key=repr))


@contextmanager
def record_variants() -> Iterator[VariantRecorder]:
    """`with record_variants() as r: ...`: the Triton kernel variants the block launched,
    keyed as Triton's JIT keys them (`triton._C.libtriton.native_specialize_impl` where this
    Triton has it: a pointer's 16-byte alignment, an int's divisibility by 16 and its being 1,
    unless the kernel says `do_not_specialize`), compiled or interpreted alike."""
    recorder = VariantRecorder()

    def hook(kernel: Any, run: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
        recorder.launches += 1
        recorder.variants.add(
            KernelVariant(_kernel_name(kernel), variant_key(kernel, args, kwargs))
        )
        return run()

    with _hooked_launches(hook):
        yield recorder


def variant_key(kernel: Any, args: tuple, kwargs: dict) -> tuple[tuple[str, str], ...]:
    """The specialisation key of one launch `kernel[grid](*args, **kwargs)`."""
    import inspect

    signature = inspect.signature(kernel.fn)
    params = signature.parameters
    bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    fixed = _flagged(kernel, "do_not_specialize", params)
    unaligned = _flagged(kernel, "do_not_specialize_on_alignment", params)
    specialize = _specializer()
    key = []
    for name, param in params.items():
        value = bound.arguments[name]
        if "constexpr" in str(param.annotation):
            key.append((name, f"constexpr={value!r}"))
        else:
            ty, spec = specialize(value, name not in fixed, name not in unaligned)
            key.append((name, f"{ty}:{spec}"))
    options = sorted((k, repr(v)) for k, v in kwargs.items() if k not in params)
    return tuple(key + [(k, f"option={v}") for k, v in options])


def _flagged(kernel: Any, attr: str, params: Any) -> set[str]:
    """Parameter names in a kernel's `do_not_specialize*` list (given by name or index)."""
    raw = getattr(kernel, attr, None)
    if raw is None:  # an interpreted kernel keeps the decorator's arguments
        raw = (getattr(kernel, "kwargs", None) or {}).get(attr)
    names = list(params)
    return {names[x] if isinstance(x, int) else x for x in raw or ()}


def _specializer() -> Callable[[Any, bool, bool], tuple[str, Any]]:
    """`(value, specialize, align) -> (type, specialisation)`: Triton's own where it has one."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:  # a Triton before 3.4: its documented rules
        return _documented_rules
    return lambda value, specialize, align: native_specialize_impl(
        BaseBackend, value, False, specialize, align
    )


def _documented_rules(value: Any, specialize: bool, align: bool) -> tuple[str, Any]:
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return type(value).__name__, None
    if isinstance(value, int):
        if specialize and value == 1:
            return "constexpr", 1
        return "int", "D" if specialize and value % 16 == 0 else ""
    if hasattr(value, "data_ptr"):
        return f"*{value.dtype}", "D" if align and value.data_ptr() % 16 == 0 else ""
    return type(value).__name__, repr(value)


def _kernel_name(kernel: Any) -> str:
    return getattr(kernel, "__name__", None) or kernel.fn.__name__


@contextmanager
def _hooked_launches(hook: Callable[[Any, Callable[[], Any], tuple, dict], Any]) -> Iterator[None]:
    """Every Triton launch in the block goes through `hook(kernel, run, args, kwargs)`."""
    patched = []
    for cls in _launcher_classes():
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            launch = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
            return hook(self, lambda: _original(self, *args, **kwargs), args, launch)

        cls.run = run
        patched.append((cls, original))
    try:
        yield
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
