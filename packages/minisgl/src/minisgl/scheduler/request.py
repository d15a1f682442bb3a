"""A request's scheduling state (what the scheduler owns; never the tokenizer's), the checks
every backend applies to a new request, and the per-token step output."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np

from minisgl.core import SamplingParams
from minisgl.scheduler.slots import SlotTable

# finish codes shared with the Rust core (`commit_step` returns one code per sample row);
# code 3 (`DROPPED`) only comes from the pipelined `commit_oldest`: the sample's request had
# already finished or was retired, its token is dropped
DROPPED = "dropped"
FINISH_REASONS: tuple[str | None, ...] = (None, "stop", "length", DROPPED)


class RequestError(ValueError):
    """The request can never be served as asked (empty prompt, longer than the context...)."""


class ContextLengthError(RequestError):
    """The prompt (plus its generated tokens) does not fit the context or the KV pool."""


def pages(tokens: int, page_size: int) -> int:
    """Pages needed to hold `tokens` tokens."""
    return -(-tokens // page_size)


def check_max_tokens(max_tokens: int, max_seq_len: int, key: str = "max_tokens") -> None:
    """A RequestError unless `max_tokens` is in [1, the context length]: the server's 400 (its
    request parser calls this) and `LLM.generate`'s error. Below it the prompt shares the
    context: prompt plus output is capped there (`validate_request`)."""
    if not 1 <= max_tokens <= max_seq_len:
        raise RequestError(
            f"'{key}' must be in [1, {max_seq_len}] (the context length), got {max_tokens}"
        )


def validate_request(
    input_ids: Sequence[int] | np.ndarray,
    params: SamplingParams,
    max_seq_len: int,
    num_pages: int,
    page_size: int,
) -> tuple[np.ndarray, int]:
    """The prompt as int32 and its total length cap, or a RequestError saying why it can never
    be served (shared by every scheduler backend). `params` were checked when they were built,
    by the table of request parameters (`minisgl.sampling_fields`); this checks what only the
    scheduler knows: the context and the KV pool. The Rust core's copy (`sched.rs`) writes the
    same messages (`tests/test_sampling_fields.py` reads them from its source)."""
    ids = np.asarray(input_ids, dtype=np.int32).reshape(-1)
    if len(ids) == 0:
        raise RequestError("prompt is empty: at least one token is required")
    if len(ids) >= max_seq_len:
        raise ContextLengthError(
            f"prompt has {len(ids)} tokens, the context holds {max_seq_len} "
            "(prompt plus at least one generated token)"
        )
    max_total = min(len(ids) + params.max_tokens, max_seq_len)
    if pages(max_total, page_size) > num_pages:
        raise ContextLengthError(
            f"request needs {max_total} tokens of KV, the pool holds {num_pages * page_size}"
        )
    return ids, max_total


class _SlotColumn:
    """A `Req` attribute kept in its `SlotTable` row: 0 while it holds no slot (a write is
    then dropped)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, req: Req | None, owner: type | None = None) -> Any:
        if req is None:
            return self
        return int(getattr(req.table, self.name)[req.slot]) if req.slot >= 0 else 0

    def __set__(self, req: Req, value: int) -> None:
        if req.slot >= 0:  # without a slot there is nothing to keep: it reads 0
            getattr(req.table, self.name)[req.slot] = value


@dataclass(eq=False)
class Req:
    rid: int
    input_ids: np.ndarray  # int32 prompt
    params: SamplingParams
    max_total_len: int  # prompt + generated tokens never exceed this
    saved_output_ids: list[int] = field(default_factory=list)  # its outputs while slotless
    slot: int = -1  # page-table row while admitted
    fill_ids: np.ndarray | None = None  # tokens to prefill (prompt, + outputs after a retract)
    cache_node: Any = None
    finish_reason: str | None = None
    cached_tokens: int = 0  # prefix-cache hit of the first admission (for stats)
    generator: Any = None
    sched_key: int = 0  # priority mode: waiting-queue order (priority * aging steps + clock)
    table: SlotTable | None = field(default=None, repr=False)  # its scheduler's slot state

    # in `table`'s row while it holds a slot, 0 otherwise
    kv_len = _SlotColumn()  # leading tokens whose KV is in the pool
    alloc_len = _SlotColumn()  # leading positions that have a KV location
    cache_len = _SlotColumn()  # leading tokens whose KV belongs to the prefix cache
    inflight = _SlotColumn()  # pipelined mode: unconfirmed steps that contain this request
    pending_out = _SlotColumn()  # pipelined mode: its samples in unconfirmed steps

    @property
    def output_ids(self) -> list[int]:
        """Its generated tokens (read from its slot's row while it holds one: a copy)."""
        if self.slot < 0:
            return self.saved_output_ids
        t = self.table
        assert t is not None
        return t.out_tok[self.slot, : t.out_len[self.slot]].tolist()

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


class StepOutput(NamedTuple):
    """One sampled token of a step (a NamedTuple: a commit builds one per running request)."""

    rid: int
    token_id: int
    finish_reason: str | None


def step_outputs(
    rids: Iterable[int], tokens: Iterable[int], reasons: Iterable[str | None]
) -> list[StepOutput]:
    """`[StepOutput(*x) for x in zip(rids, tokens, reasons)]` without a Python call per output
    (what `StepOutput.__new__` does, from C)."""
    return list(map(tuple.__new__, repeat(StepOutput), zip(rids, tokens, reasons)))
