"""The per-step plan: every decision of one scheduler step, as flat arrays.

`build_step_plan` is the single place that turns "these requests, these token ranges" into
the engine's inputs (positions, input mapping, KV write mapping, KV read mapping, output
locations). It is pure: arrays in, arrays out, so a Rust implementation can replace exactly
this with one call per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepPlan:
    is_prefill: bool
    slots: np.ndarray  # [bs] page-table row of each request
    input_ids: np.ndarray  # [T] tokens fed this step
    positions: np.ndarray  # [T] absolute position of each fed token
    out_loc: np.ndarray  # [T] KV write mapping: pool location of each fed token
    extend_lens: np.ndarray  # [bs] tokens fed per request
    seq_lens: np.ndarray  # [bs] KV length of each request after this step
    kv_indptr: np.ndarray  # [bs + 1] offsets into kv_indices
    kv_indices: np.ndarray  # [sum(seq_lens)] KV read mapping (token-level locations)
    logits_indices: np.ndarray  # [n_sample] row in T whose logits are sampled
    sample_rows: np.ndarray  # [n_sample] which requests of the batch sample a token

    @property
    def batch_size(self) -> int:
        return int(self.slots.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_step_plan(
    page_table: np.ndarray,
    slots: np.ndarray,
    starts: np.ndarray,
    extend_lens: np.ndarray,
    input_ids: np.ndarray,
    sample_mask: np.ndarray,
    is_prefill: bool,
) -> StepPlan:
    """Requests `slots` feed tokens [starts, starts + extend_lens); `input_ids` is their concat."""
    slots = np.asarray(slots, dtype=np.int32)
    starts = np.asarray(starts, dtype=np.int32)
    extend_lens = np.asarray(extend_lens, dtype=np.int32)
    seq_lens = starts + extend_lens
    bs = len(slots)
    q_indptr = np.zeros(bs + 1, dtype=np.int64)
    np.cumsum(extend_lens, out=q_indptr[1:])
    total = int(q_indptr[-1])
    # positions: for each fed token, start of its request + offset inside the request
    req_of_token = np.repeat(np.arange(bs, dtype=np.int64), extend_lens)
    offset = np.arange(total, dtype=np.int64) - q_indptr[req_of_token]
    positions = (starts[req_of_token] + offset).astype(np.int32)
    rows = slots[req_of_token]
    out_loc = page_table[rows, positions]
    kv_indptr = np.zeros(bs + 1, dtype=np.int64)
    np.cumsum(seq_lens, out=kv_indptr[1:])
    req_of_kv = np.repeat(np.arange(bs, dtype=np.int64), seq_lens)
    kv_pos = np.arange(int(kv_indptr[-1]), dtype=np.int64) - kv_indptr[req_of_kv]
    kv_indices = page_table[slots[req_of_kv], kv_pos]
    sample_rows = np.flatnonzero(np.asarray(sample_mask, dtype=bool)).astype(np.int32)
    logits_indices = (q_indptr[1:][sample_rows] - 1).astype(np.int32)
    return StepPlan(
        is_prefill=is_prefill,
        slots=slots,
        input_ids=np.asarray(input_ids, dtype=np.int32),
        positions=positions,
        out_loc=out_loc.astype(np.int32, copy=False),
        extend_lens=extend_lens,
        seq_lens=seq_lens.astype(np.int32),
        kv_indptr=kv_indptr.astype(np.int32),
        kv_indices=kv_indices.astype(np.int32, copy=False),
        logits_indices=logits_indices,
        sample_rows=sample_rows,
    )
