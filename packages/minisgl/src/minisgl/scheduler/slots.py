"""Per-slot request state as arrays, so a decode step reads and advances every running request
with a few numpy operations (no per-request Python loop).

Row `slot` describes the request that holds page-table row `slot`; a `Req` reads and writes
its lengths and in-flight counters here while it holds one (`Req.kv_len` ...) and reads its
output tokens from `out_tok` (`Req.output_ids`). A row is written whole by `admit` and is
meaningless while its slot is free.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SlotTable:
    """One int64 / bool array per field, indexed by slot (`out_tok`: one row per slot)."""

    rid: np.ndarray  # request id
    kv_len: np.ndarray  # leading tokens whose KV is in the pool
    alloc_len: np.ndarray  # leading positions that have a KV location
    cache_len: np.ndarray  # leading tokens whose KV belongs to the prefix cache
    fill_len: np.ndarray  # tokens to prefill
    out_len: np.ndarray  # committed output tokens
    out_limit: np.ndarray  # outputs that finish it by length: max_tokens, or the context's
    last_token: np.ndarray  # the last committed output token (-1: none yet)
    max_total_len: np.ndarray  # prompt + outputs never exceed this
    inflight: np.ndarray  # pipelined: unconfirmed steps that contain the request
    pending_out: np.ndarray  # pipelined: its samples in unconfirmed steps
    eos_stops: np.ndarray  # bool: an EOS id finishes it (not `ignore_eos`)
    has_stop: np.ndarray  # bool: stop_token_ids is not empty
    done: np.ndarray  # bool: finished or retired (pipelined: still holding the slot)
    out_tok: np.ndarray  # [slot, i]: its i-th output token, i < out_len (int32)

    @classmethod
    def empty(cls, max_slots: int, max_seq_len: int) -> SlotTable:
        def ints() -> np.ndarray:
            return np.zeros(max_slots, dtype=np.int64)

        def flags() -> np.ndarray:
            return np.zeros(max_slots, dtype=bool)

        return cls(ints(), ints(), ints(), ints(), ints(), ints(), ints(), ints(), ints(),
                   ints(), ints(), flags(), flags(), flags(),
                   np.zeros((max_slots, max_seq_len), dtype=np.int32))  # fmt: skip

    def admit(
        self,
        slot: int,
        rid: int,
        prefix: int,
        fill_len: int,
        input_len: int,
        output_ids: list[int],
        max_tokens: int,
        max_total_len: int,
        ignore_eos: bool,
        has_stop: bool,
    ) -> None:
        """Row `slot` for a request admitted with `prefix` tokens of KV from the cache."""
        self.rid[slot] = rid
        self.kv_len[slot] = self.alloc_len[slot] = self.cache_len[slot] = prefix
        self.fill_len[slot] = fill_len
        self.out_len[slot] = len(output_ids)
        self.out_tok[slot, : len(output_ids)] = output_ids
        self.out_limit[slot] = min(max_tokens, max_total_len - input_len)
        self.last_token[slot] = output_ids[-1] if output_ids else -1
        self.max_total_len[slot] = max_total_len
        self.inflight[slot] = self.pending_out[slot] = 0
        self.eos_stops[slot], self.has_stop[slot] = not ignore_eos, has_stop
        self.done[slot] = False

    def length_certain(self, slots: np.ndarray) -> np.ndarray:
        """Committed plus in-flight samples reach a length limit (pipelined: the last
        unconfirmed sample finishes the request)."""
        return self.out_len[slots] + self.pending_out[slots] >= self.out_limit[slots]

    def append(self, slots: np.ndarray, tokens: np.ndarray, out_len: np.ndarray) -> None:
        """One output token more for each of `slots` (distinct; `out_len`: theirs now)."""
        self.out_tok[slots, out_len] = tokens
        self.out_len[slots] = out_len + 1
        self.last_token[slots] = tokens
