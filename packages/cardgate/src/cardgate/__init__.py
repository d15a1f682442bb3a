"""pytest-cardgate: kanban cards bound to tests, and a gate that records evidence."""

from __future__ import annotations

__version__ = "0.1.0"
