"""Shared helpers of the quantized-layer tests: a small int8 layer with the weights it
multiplies, and a count of the de-quantization calls behind the layers' operators."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minisgl.quantization import linear
from minisgl.quantization.linear import Int8Linear
from minisgl.quantization.packed import quantize_int8


def linear_weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [160, 192] weight and its bias."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(160, 192, generator=g) * 0.3, torch.randn(160, generator=g) * 0.1


def int8_layer(dtype: torch.dtype, seed: int = 0) -> tuple[Int8Linear, torch.Tensor, torch.Tensor]:
    """An int8 layer of `linear_weights(seed)`, the weights it multiplies (int8 codes times the
    scales rounded to `dtype`) and its bias, both in `dtype`."""
    w, bias = linear_weights(seed)
    q = quantize_int8(w)
    deq = q.q * q.scale.to(dtype)[:, None]
    return Int8Linear(q, bias, dtype), deq, bias.to(dtype)


def count_dequantizations(monkeypatch: Any, active: Callable[[], bool] | None = None) -> list[str]:
    """Patches `quantization.linear.dequantize_int8` / `dequantize_int4` (which the layers'
    operators look up at each call) to append "int8" / "int4" to the returned list on each
    call while `active()` holds (always without it): a call at run time means a graph did not
    fold the float weights into a constant, or a batch multiplied a de-quantized copy."""
    calls: list[str] = []
    for kind in ("int8", "int4"):
        name = f"dequantize_{kind}"
        fn = getattr(linear, name, None)
        assert fn is not None, f"quantization.linear.{name} is missing"

        def counted(*args: torch.Tensor, fn: Any = fn, kind: str = kind) -> torch.Tensor:
            if active is None or active():
                calls.append(kind)
            return fn(*args)

        monkeypatch.setattr(linear, name, counted)
    return calls
