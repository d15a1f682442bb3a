"""A request's scheduling state (what the scheduler owns; never the tokenizer's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minisgl.core import SamplingParams


@dataclass(eq=False)
class Req:
    rid: int
    input_ids: np.ndarray  # int32 prompt
    params: SamplingParams
    max_total_len: int  # prompt + generated tokens never exceed this
    output_ids: list[int] = field(default_factory=list)
    slot: int = -1  # page-table row while admitted
    fill_ids: np.ndarray | None = None  # tokens to prefill (prompt, + outputs after a retract)
    kv_len: int = 0  # leading tokens whose KV is in the pool
    alloc_len: int = 0  # leading positions that have a KV location
    cache_len: int = 0  # leading tokens whose KV belongs to the prefix cache
    cache_node: Any = None
    finish_reason: str | None = None
    cached_tokens: int = 0  # prefix-cache hit of the first admission (for stats)
    generator: Any = None

    @property
    def prefill_len(self) -> int:
        assert self.fill_ids is not None
        return len(self.fill_ids)

    @property
    def in_prefill(self) -> bool:
        return self.fill_ids is not None and self.kv_len < self.prefill_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def all_tokens(self) -> np.ndarray:
        out = np.asarray(self.output_ids, dtype=np.int32)
        return np.concatenate([self.input_ids, out]) if len(out) else self.input_ids


@dataclass(frozen=True)
class StepOutput:
    rid: int
    token_id: int
    finish_reason: str | None
