"""Speculative decoding: draft sources and their configuration (issue 62).

A `DraftSource` proposes up to k tokens for a request from its tokens so far; the scheduler
(`speculative.scheduler.SpecScheduler`) feeds them with the request's last token as one verify
row of k + 1 positions, and keeps the longest prefix the target's argmax agrees with, plus the
target's own next token. Weightless sources join `DRAFT_SOURCES` by name (`register_draft_source`): `ngram` (prompt
lookup). `draft` (SGLang's `standalone`) is a draft model sharing the target's tokenizer; it
needs an engine of its own, so the runtime builds it (`runtime/draft_model.py`) and hands it to
the scheduler; EAGLE-style heads would take the same seat.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


DRAFT_MODEL = "draft"  # a draft model: built by the runtime (it needs an engine)
ALIASES = {"standalone": DRAFT_MODEL}  # SGLang's name of a draft model


class DraftSource(Protocol):
    """Proposes draft tokens for the requests of a step. `exact`: it proposes exactly the k
    tokens it is asked for and its tokens cost forwards (a draft model), so a step asks only
    for what its budget takes; otherwise (n-gram lookup) it may propose fewer, cheaply, and
    the step trims what it proposed."""

    name: str
    exact: bool

    def propose_many(self, tokens: Sequence[np.ndarray], ks: Sequence[int]) -> list[np.ndarray]:
        """Per request, up to `ks[i]` int32 tokens likely to follow `tokens[i]` (its prompt,
        then its outputs); an empty array where `ks[i]` is 0 or nothing fits."""
        ...


def _ngram(config: SpecConfig) -> DraftSource:
    from minisgl.speculative.ngram import NgramDraft

    return NgramDraft()


DRAFT_SOURCES: dict[str, Callable[[SpecConfig], DraftSource]] = {"ngram": _ngram}


def algorithms() -> list[str]:
    """Every `speculative_algorithm` name (aliases aside)."""
    return sorted({*DRAFT_SOURCES, DRAFT_MODEL})


def register_draft_source(name: str, factory: Callable[[SpecConfig], DraftSource]) -> None:
    if name in DRAFT_SOURCES:
        raise ValueError(f"draft source {name!r} is already registered")
    DRAFT_SOURCES[name] = factory


@dataclass(frozen=True)
class SpecConfig:
    """`speculative_algorithm` (`algorithms()`), `speculative_num_draft_tokens` (k, the most
    drafts a verify row carries), `max_step_rows` (the most rows a verify step holds: a step
    whose running requests fill it drafts nothing) and `draft_model_path` (the draft model's
    folder: the `draft` algorithm's, and only its)."""

    algorithm: str
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS
    max_step_rows: int = DEFAULT_MAX_STEP_ROWS
    draft_model_path: str | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in algorithms():
            raise ValueError(
                f"unknown speculative_algorithm {self.algorithm!r}: expected one of "
                f"{', '.join(algorithms())}"
            )
        path = self.draft_model_path
        if self.algorithm == DRAFT_MODEL and (not isinstance(path, str) or not path.strip()):
            raise ValueError(
                "speculative_algorithm 'draft' needs the draft model's path "
                "(speculative_draft_model_path / --speculative-draft-model-path)"
            )
        if self.algorithm != DRAFT_MODEL and path is not None:
            raise ValueError(
                "a draft model path (speculative_draft_model_path / "
                f"--speculative-draft-model-path) goes with speculative_algorithm 'draft', "
                f"not {self.algorithm!r}"
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
        draft_model_path: str | None = None,
    ) -> SpecConfig | None:
        """The configuration the user options ask for; None for no speculation."""
        if algorithm is None:
            for name, value in (("speculative_num_draft_tokens", num_draft_tokens),
                                ("speculative_max_step_rows", max_step_rows),
                                ("speculative_draft_model_path", draft_model_path)):  # fmt: skip
                if value is not None:
                    raise ValueError(
                        f"{name} needs a speculative_algorithm ({', '.join(algorithms())})"
                    )
            return None
        if not isinstance(algorithm, str):
            raise ValueError(
                f"speculative_algorithm must be a string, got {type(algorithm).__name__}"
            )
        name = algorithm.strip().lower()
        k = DEFAULT_DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens
        rows = DEFAULT_MAX_STEP_ROWS if max_step_rows is None else max_step_rows
        path = None if draft_model_path is None else str(draft_model_path)
        return cls(ALIASES.get(name, name), k, rows, path)


def make_draft_source(config: SpecConfig) -> DraftSource:
    """A weightless source of `DRAFT_SOURCES` (a draft model comes from the runtime)."""
    if config.algorithm not in DRAFT_SOURCES:
        raise ValueError(
            f"speculative_algorithm {config.algorithm!r} needs the target's engine: the runtime "
            "builds its draft source (runtime/draft_model.py)"
        )
    return DRAFT_SOURCES[config.algorithm](config)
