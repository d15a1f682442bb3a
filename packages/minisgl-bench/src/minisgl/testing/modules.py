"""A module a test needs, imported so that its absence fails the test by assertion (a red
record's failure must be an assertion in the test body, not an ImportError: docs/cardgate.md)."""

from __future__ import annotations

import importlib
from types import ModuleType


def require_module(name: str) -> ModuleType:
    """`importlib.import_module(name)`; AssertionError where the module does not exist."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        raise AssertionError(f"{name} is missing") from None
