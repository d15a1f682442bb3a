"""A decoder layer as the C decode steps read it (`decode_step.c`: int4, `decode_step_w8a8.c`:
w8a8): its four matrices (each kind's record from `.struct()`), norms and KV pools."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

_PTR = ctypes.c_void_p


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address for a C record, None for an absent one."""
    return None if t is None else t.data_ptr()


class Matrix(Protocol):
    def struct(self) -> ctypes.Structure: ...


M = TypeVar("M", bound=Matrix)


@dataclass(frozen=True)
class LayerWeights(Generic[M]):
    """One decoder layer: its four linears, the bf16 input norms (the w8a8 step's: those its
    QKV and gate/up fold), q_norm / k_norm or None."""

    qkv: M
    o: M
    gate_up: M
    down: M
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def layer_record(mat: type[ctypes.Structure]) -> type[ctypes.Structure]:
    """The C struct of a layer whose matrices are `mat` records (the C side's layout)."""
    fields = [("qkv", mat), ("o", mat), ("gate_up", mat), ("down", mat), ("in_norm", _PTR),
              ("post_norm", _PTR), ("q_norm", _PTR), ("k_norm", _PTR), ("k_pool", _PTR),
              ("v_pool", _PTR)]  # fmt: skip
    return type(f"Layer_{mat.__name__}", (ctypes.Structure,), {"_fields_": fields})


def layer_structs(record: type[ctypes.Structure], layers: list[LayerWeights],
                  k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]) -> ctypes.Array:  # fmt: skip
    """The C array of a decode step's layer records (pointers into the given tensors: keep
    them alive as long as the array)."""
    arr = (record * len(layers))()
    for i, (w, kp, vp) in enumerate(zip(layers, k_pools, v_pools, strict=True)):
        arr[i] = record(w.qkv.struct(), w.o.struct(), w.gate_up.struct(), w.down.struct(),
                        w.in_norm.data_ptr(), w.post_norm.data_ptr(), ptr(w.q_norm),
                        ptr(w.k_norm), kp.data_ptr(), vp.data_ptr())  # fmt: skip
    return arr
