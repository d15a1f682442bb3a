"""Speculative decoding: draft sources and their configuration (issue 62).

A `DraftSource` proposes up to k tokens for a request from its tokens so far; the scheduler
(`speculative.scheduler.SpecScheduler`) feeds them with the request's last token as one verify
row of k + 1 positions, and keeps the longest prefix the target's argmax agrees with, plus the
target's own next token. Sources join `DRAFT_SOURCES` by name (`register_draft_source`): `ngram`
(prompt lookup) now; a draft model and EAGLE-style heads later take the same seat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 16
# Rows a verify step may hold, drafts filling what the running requests leave. A row costs
# arithmetic once the weights are read (the CPU int4 GEMM, 1536 x 576, intel-amx: 26 us for 1
# row, 46 for 4, 71 for 8, 128 for 16): drafts pay where a step has few rows. 16 concurrent
# requests drafting 4 each ran 27% slower than without speculation.
DEFAULT_MAX_STEP_ROWS = 8


class DraftSource(Protocol):
    """Proposes draft tokens for one request."""

    name: str

    def propose(self, tokens: np.ndarray, k: int) -> np.ndarray:
        """Up to `k` int32 tokens likely to follow `tokens` (the prompt, then the outputs)."""
        ...


def _ngram(config: SpecConfig) -> DraftSource:
    from minisgl.speculative.ngram import NgramDraft

    return NgramDraft()


DRAFT_SOURCES: dict[str, Callable[[SpecConfig], DraftSource]] = {"ngram": _ngram}


def register_draft_source(name: str, factory: Callable[[SpecConfig], DraftSource]) -> None:
    if name in DRAFT_SOURCES:
        raise ValueError(f"draft source {name!r} is already registered")
    DRAFT_SOURCES[name] = factory


@dataclass(frozen=True)
class SpecConfig:
    """`speculative_algorithm` (a `DRAFT_SOURCES` name), `speculative_num_draft_tokens` (k,
    the most drafts a verify row carries) and `max_step_rows` (the most rows a verify step
    holds: a step whose running requests fill it drafts nothing)."""

    algorithm: str
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS
    max_step_rows: int = DEFAULT_MAX_STEP_ROWS

    def __post_init__(self) -> None:
        if self.algorithm not in DRAFT_SOURCES:
            raise ValueError(
                f"unknown speculative_algorithm {self.algorithm!r}: expected one of "
                f"{', '.join(DRAFT_SOURCES)}"
            )
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"speculative_num_draft_tokens must be an int in [1, {MAX_DRAFT_TOKENS}], got {k!r}"
            )
        rows = self.max_step_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 2:
            raise ValueError(f"max_step_rows must be an int >= 2, got {rows!r}")

    @classmethod
    def parse(
        cls,
        algorithm: str | None,
        num_draft_tokens: int | None,
        max_step_rows: int | None = None,
    ) -> SpecConfig | None:
        """The configuration the user options ask for; None for no speculation."""
        if algorithm is None:
            for name, value in (("speculative_num_draft_tokens", num_draft_tokens),
                                ("speculative_max_step_rows", max_step_rows)):  # fmt: skip
                if value is not None:
                    raise ValueError(f"{name} needs a speculative_algorithm (ngram)")
            return None
        if not isinstance(algorithm, str):
            raise ValueError(
                f"speculative_algorithm must be a string, got {type(algorithm).__name__}"
            )
        k = DEFAULT_DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens
        rows = DEFAULT_MAX_STEP_ROWS if max_step_rows is None else max_step_rows
        return cls(algorithm.strip().lower(), k, rows)


def make_draft_source(config: SpecConfig) -> DraftSource:
    return DRAFT_SOURCES[config.algorithm](config)
