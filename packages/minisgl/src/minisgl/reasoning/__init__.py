"""Reasoning models (issue 63): the `<think>...</think>` text of a model's output split off as
`reasoning_content` (`formats`: a parser per model family, whole and streamed) and the
grammars of `response_format` / tools given a free `<think>` block before the answer
(`grammar`, imported on first use: it needs `minisgl.structured`)."""

from typing import Any

from minisgl.reasoning.formats import (
    REASONING_FORMATS,
    ReasoningFormat,
    ReasoningStream,
    Split,
    get_reasoning_format,
)

__all__ = [
    "REASONING_FORMATS",
    "ReasoningFormat",
    "ReasoningStream",
    "Split",
    "get_reasoning_format",
    "tag_tokens",
    "with_reasoning",
]


def __getattr__(name: str) -> Any:
    if name in ("tag_tokens", "with_reasoning"):
        from minisgl.reasoning import grammar

        return getattr(grammar, name)
    raise AttributeError(f"module 'minisgl.reasoning' has no attribute {name!r}")
