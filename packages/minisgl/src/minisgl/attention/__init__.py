"""Attention backends behind one interface, chosen by name (`--attention-backend`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minisgl.attention.base import AttentionBackend

_REGISTRY: dict[str, Callable[..., AttentionBackend]] = {}


def register_backend(name: str):
    def wrap(factory: Callable[..., AttentionBackend]):
        _REGISTRY[name] = factory
        return factory

    return wrap


def available_backends() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def create_backend(name: str, **kwargs) -> AttentionBackend:
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {available_backends()}")
    return _REGISTRY[name](**kwargs)


def _load_builtin() -> None:
    import minisgl.attention.torch_native  # noqa: F401  (registers itself)
