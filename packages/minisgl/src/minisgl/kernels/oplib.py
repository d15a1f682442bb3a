"""The `minisgl` operator namespace: one place that registers the CPU kernels' operators.

`define_op(schema, cpu=..., meta=...)` defines `torch.ops.minisgl.<name>` from its schema with
a CPU implementation and a Meta one (shapes and dtypes only, for `torch.compile` and export).
A plain `torch.library.Library` fragment, not `torch.library.custom_op`: a decode step calls
some of these once per layer, and the custom-op wrapper costs ~11 us a call (a raw call at
batch 1 takes ~8).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NAMESPACE = "minisgl"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def define_op(schema: str, *, cpu: Callable[..., object], meta: Callable[..., object]) -> object:
    """Define `torch.ops.minisgl.<name>` (the schema's name) with its CPU and Meta kernels;
    returns the operator's default overload."""
    name = schema.split("(", 1)[0].strip()
    _LIB.define(schema)
    _LIB.impl(name, cpu, "CPU")
    _LIB.impl(name, meta, "Meta")
    return getattr(getattr(torch.ops, NAMESPACE), name).default
