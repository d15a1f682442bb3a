"""minisgl: a small, fast LLM serving runtime with a Rust CPU hot path."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM


def __getattr__(name: str):  # heavy imports (torch, transformers) stay lazy
    if name == "LLM":
        from minisgl.llm import LLM

        return LLM
    if name == "SamplingParams":
        from minisgl.core import SamplingParams

        return SamplingParams
    raise AttributeError(name)
