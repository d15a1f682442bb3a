"""Detect device -> host reads: the calls that make the host wait for the device.

A CUDA stream runs ahead of the host only while the host never asks for a device value;
`.item()`, `.tolist()`, `bool(t)`, a boolean mask index (`nonzero`), a copy to the CPU... each
stalls it. `torch.cuda.set_sync_debug_mode("error")` catches them on a GPU; `SyncGuard` catches
them on any device, CPU included (where nothing stalls, so nothing would show it otherwise):

- a `TorchDispatchMode` that raises on the aten ops whose result size or value the host must
  read (`_local_scalar_dense` behind `.item()` / `int(t)` / `bool(t)`, `nonzero`,
  `masked_select`, `unique`, `repeat_interleave` without `output_size`, `equal`, indexing
  with a boolean mask...) and on every copy from a non-CPU tensor to the CPU;
- `Tensor.tolist`, `Tensor.numpy` and `Tensor.__array__`, which read memory without going
  through the dispatcher, replaced for the duration of the block.

Creating tensors from host data (host -> device) is allowed: that is what staging does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostSyncError(RuntimeError):
    """A device -> host read inside a `SyncGuard` block."""


_SYNC_OPS = frozenset(
    {
        aten._local_scalar_dense,
        aten.item,  # seen instead of _local_scalar_dense under inference_mode
        aten.is_nonzero,
        aten.equal,
        aten.nonzero,
        aten.masked_select,
        aten._unique,
        aten._unique2,
        aten.unique_dim,
        aten.unique_consecutive,
        aten.bincount,
        aten.histc,
    }
)
_COPY_OPS = frozenset({aten._to_copy, aten.copy_, aten.to})
# indexing with a boolean mask: the number of selected elements is read on the host
_INDEX_OPS = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})
_PATCHED = ("tolist", "numpy", "__array__")


def _is_device(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _SYNC_OPS:
            raise HostSyncError(f"{func} reads a device value on the host")
        if packet in _INDEX_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            raise HostSyncError(f"{func} with a boolean mask sizes its output on the host")
        if (
            packet is aten.repeat_interleave
            and kwargs.get("output_size") is None
            and len(args) == 1
            and isinstance(args[0], torch.Tensor)
        ):
            raise HostSyncError(f"{func} without output_size sizes its output on the host")
        if packet in _COPY_OPS:
            dst = args[0] if packet is aten.copy_ else None
            src = args[1] if packet is aten.copy_ else args[0]
            to_host = (
                dst.device.type == "cpu"
                if dst is not None
                else str(kwargs.get("device", getattr(src, "device", "cpu"))).startswith("cpu")
            )
            if _is_device(src) and to_host:
                raise HostSyncError(f"{func} copies a {src.device} tensor to the host")
        return func(*args, **kwargs)


@contextmanager
def SyncGuard() -> Iterator[None]:
    """Raise `HostSyncError` on any device -> host read inside the block."""
    saved = {name: getattr(torch.Tensor, name) for name in _PATCHED}

    def refuse(name: str):
        def method(self, *args, **kwargs):
            raise HostSyncError(f"Tensor.{name}() reads tensor data on the host")

        return method

    for name in _PATCHED:
        setattr(torch.Tensor, name, refuse(name))
    try:
        with _Mode():
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
