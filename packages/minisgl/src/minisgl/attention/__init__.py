"""Attention backends behind one interface, chosen by name (`--attention-backend`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from minisgl.utils.log import get_logger

if TYPE_CHECKING:
    import torch

    from minisgl.attention.base import AttentionBackend

logger = get_logger(__name__)

_REGISTRY: dict[str, Callable[..., AttentionBackend]] = {}
# Backends whose module imports an optional dependency: imported only when asked for, so a
# missing or broken dependency makes just that backend unavailable (with the reason).
_OPTIONAL = {"triton": "minisgl.attention.triton_backend"}
AUTO = "auto"


def register_backend(name: str):
    def wrap(factory: Callable[..., AttentionBackend]):
        _REGISTRY[name] = factory
        return factory

    return wrap


def available_backends() -> list[str]:
    """Every backend name `create_backend` accepts (an optional one may still be unavailable)."""
    _load_builtin()
    return sorted({*_REGISTRY, *_OPTIONAL, AUTO})


def unavailable_reason(name: str) -> str | None:
    """None if backend `name` can be created here, else why not (e.g. its import failed)."""
    _load_builtin()
    if name in _REGISTRY:
        return None
    module = _OPTIONAL.get(name)
    if module is None:
        return f"unknown attention backend {name!r}; available: {available_backends()}"
    try:
        importlib.import_module(module)  # registers itself
    except ImportError as e:
        return f"attention backend {name!r} is unavailable: {type(e).__name__}: {e}"
    return None


def resolve_backend(name: str, device: torch.device) -> str:
    """`auto` -> triton on CUDA when triton imports, else torch_native; logs the choice."""
    if name != AUTO:
        logger.info("attention backend %s (asked for by name)", name)
        return name
    if device.type != "cuda":
        choice, why = "torch_native", f"device is {device.type}, triton kernels need CUDA"
    elif (reason := unavailable_reason("triton")) is not None:
        choice, why = "torch_native", reason
    else:
        choice, why = "triton", "CUDA device and triton imports"
    logger.info("attention backend auto -> %s (%s)", choice, why)
    return choice


def create_backend(name: str, **kwargs) -> AttentionBackend:
    name = resolve_backend(name, kwargs["device"]) if name == AUTO else name
    reason = unavailable_reason(name)
    if reason is not None:
        raise (RuntimeError if name in _OPTIONAL else ValueError)(reason)
    return _REGISTRY[name](**kwargs)


def _load_builtin() -> None:
    import minisgl.attention.torch_native  # noqa: F401  (registers itself)
