"""The per-step plan: every decision of one scheduler step, as flat arrays.

`build_step_plan` is the single place that turns "these requests, these token ranges" into
the engine's inputs (positions, input mapping, KV write mapping, KV read mapping, output
locations). It is pure: arrays in, arrays out, so a Rust implementation can replace exactly
this with one call per step.

A plan also travels as one flat int32 buffer (`FlatStep`): the Rust core writes it, and the
future out-of-process service sends it. Its layout is defined once here (`PLAN_SEGMENTS`);
`minisgl_cpu.plan_segments` exports the Rust core's layout by name and a test asserts the two
are equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

DIMS = ("bs", "num_tokens", "num_kv", "num_sample")
Dim = Literal["bs", "num_tokens", "num_kv", "num_sample"]

# (name, dimension, extra): the segment holds `layout.<dimension> + extra` int32 values.
PLAN_SEGMENTS: tuple[tuple[str, Dim, int], ...] = (
    ("slots", "bs", 0),
    ("extend_lens", "bs", 0),
    ("seq_lens", "bs", 0),
    ("kv_indptr", "bs", 1),
    ("input_ids", "num_tokens", 0),
    ("positions", "num_tokens", 0),
    ("out_loc", "num_tokens", 0),
    ("kv_indices", "num_kv", 0),
    ("logits_indices", "num_sample", 0),
    ("sample_rows", "num_sample", 0),
    ("batch_pos", "bs", 0),  # prefill: position in the running list of each batch request
)
# the segments a `StepPlan` carries, in its field order (`batch_pos` is the scheduler's own)
PLAN_FIELDS: tuple[str, ...] = tuple(name for name, _, _ in PLAN_SEGMENTS[:-1])
_SIZES = tuple((DIMS.index(dim), extra) for _, dim, extra in PLAN_SEGMENTS)
_INT32 = np.dtype(np.int32)


@dataclass(frozen=True)
class StepPlan:
    is_prefill: bool
    slots: np.ndarray  # [bs] page-table row of each request
    extend_lens: np.ndarray  # [bs] tokens fed per request
    seq_lens: np.ndarray  # [bs] KV length of each request after this step
    kv_indptr: np.ndarray  # [bs + 1] offsets into kv_indices
    input_ids: np.ndarray  # [T] tokens fed this step
    positions: np.ndarray  # [T] absolute position of each fed token
    out_loc: np.ndarray  # [T] KV write mapping: pool location of each fed token
    kv_indices: np.ndarray  # [sum(seq_lens)] KV read mapping (token-level locations)
    logits_indices: np.ndarray  # [n_sample] row in T whose logits are sampled
    sample_rows: np.ndarray  # [n_sample] which requests of the batch sample a token

    @property
    def batch_size(self) -> int:
        return int(self.slots.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class PlanLayout(NamedTuple):
    """Sizes of a flat plan buffer (`minisgl_cpu_core::plan::PlanLayout`)."""

    bs: int
    num_tokens: int
    num_kv: int
    num_sample: int

    def segments(self) -> tuple[tuple[str, int, int], ...]:
        """`(name, offset, length)` of each segment, in buffer order."""
        out: list[tuple[str, int, int]] = []
        off = 0
        for (name, _, _), (dim, extra) in zip(PLAN_SEGMENTS, _SIZES, strict=True):
            n = self[dim] + extra
            out.append((name, off, n))
            off += n
        return tuple(out)

    @property
    def total(self) -> int:
        return sum(self[dim] + extra for dim, extra in _SIZES)

    @classmethod
    def of(cls, plan: StepPlan) -> PlanLayout:
        return cls(
            plan.batch_size, plan.num_tokens, int(plan.kv_indices.shape[0]),
            int(plan.sample_rows.shape[0]),
        )  # fmt: skip


def split_flat(sizes: tuple[int, int, int, int], data: np.ndarray) -> list[np.ndarray]:
    """The segments of a flat plan buffer of `sizes` (a `PlanLayout`), as views, in
    `PLAN_SEGMENTS` order (the hot path of every Rust step: keep it lean)."""
    out: list[np.ndarray] = []
    off = 0
    for dim, extra in _SIZES:
        end = off + sizes[dim] + extra
        out.append(data[off:end])
        off = end
    if data.shape != (off,) or data.dtype != _INT32:
        raise ValueError(
            f"flat plan: expected int32[{off}] for {PlanLayout(*sizes)}, "
            f"got {data.dtype}{list(data.shape)}"
        )
    return out


@dataclass(frozen=True)
class FlatStep:
    """One step plan as a single int32 buffer laid out as `PLAN_SEGMENTS` (the wire form)."""

    is_prefill: bool
    layout: PlanLayout
    data: np.ndarray  # [layout.total] int32

    def __post_init__(self) -> None:
        split_flat(self.layout, self.data)  # raises on a buffer of another size or type

    def segment(self, name: str) -> np.ndarray:
        for seg, off, n in self.layout.segments():
            if seg == name:
                return self.data[off : off + n]
        raise KeyError(name)

    def split(self) -> tuple[StepPlan, np.ndarray]:
        """The `StepPlan` (views of `data`, no copy) and the `batch_pos` segment."""
        *fields, batch_pos = split_flat(self.layout, self.data)
        return StepPlan(self.is_prefill, *fields), batch_pos

    def plan(self) -> StepPlan:
        return self.split()[0]

    @classmethod
    def of(cls, plan: StepPlan, batch_pos: np.ndarray | None = None) -> FlatStep:
        """Flatten `plan` (`batch_pos` defaults to `0..bs`)."""
        layout = PlanLayout.of(plan)
        if batch_pos is None:
            batch_pos = np.arange(layout.bs, dtype=np.int32)
        parts = [getattr(plan, f) for f in PLAN_FIELDS] + [batch_pos]
        data = np.concatenate([np.asarray(a, dtype=np.int32) for a in parts])
        return cls(plan.is_prefill, layout, data)


def unknown_inputs(plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
    """`(token index, slot)` of each input still in flight (`-1`: a pipelined decode input,
    the last token sampled in that row's page-table slot)."""
    unknown = np.flatnonzero(plan.input_ids < 0)
    if not len(unknown):
        return unknown, unknown
    row_of = np.repeat(np.arange(len(plan.extend_lens)), plan.extend_lens)
    return unknown, plan.slots[row_of[unknown]]


def _arange(n: int) -> np.ndarray:
    """`np.arange(n)` (int64) as a view of a cached buffer (read only; grown on demand)."""
    global _ARANGE
    if len(_ARANGE) < n:
        _ARANGE = np.arange(max(n, 2 * len(_ARANGE)), dtype=np.int64)
        _ARANGE.flags.writeable = False
    return _ARANGE[:n]


_ARANGE = np.zeros(0, dtype=np.int64)


def build_step_plan(
    page_table: np.ndarray,
    slots: np.ndarray,
    starts: np.ndarray,
    extend_lens: np.ndarray,
    input_ids: np.ndarray,
    sample_mask: np.ndarray,
    is_prefill: bool,
) -> StepPlan:
    """Requests `slots` feed tokens [starts, starts + extend_lens); `input_ids` is their concat.

    Whole-batch numpy: every token-level array is one gather from the flat page table at
    `slot * width + position`, the position ranges laid out by `np.repeat` of per-request
    offsets over a shared `arange`."""
    slots = np.asarray(slots, dtype=np.int32)
    starts = np.asarray(starts, dtype=np.int32)
    extend_lens = np.asarray(extend_lens, dtype=np.int32)
    seq_lens = starts + extend_lens
    bs = len(slots)
    flat = page_table.reshape(-1)
    row0 = slots.astype(np.int64) * page_table.shape[1]  # flat index of each slot's row
    if (extend_lens == 1).all():  # decode: token i is request i's
        q_indptr = _arange(bs + 1)
        positions = starts.copy()
        out_loc = flat.take(row0 + starts)
    else:
        q_indptr = np.zeros(bs + 1, dtype=np.int64)
        np.cumsum(extend_lens, out=q_indptr[1:])
        # token t of request i sits at position starts[i] + (t - q_indptr[i])
        pos_shift = np.repeat(starts - q_indptr[:-1], extend_lens)
        pos_shift += _arange(int(q_indptr[-1]))
        positions = pos_shift.astype(np.int32)
        pos_shift += np.repeat(row0, extend_lens)
        out_loc = flat.take(pos_shift)
    kv_indptr = np.zeros(bs + 1, dtype=np.int64)
    np.cumsum(seq_lens, out=kv_indptr[1:])
    # KV entry k of request i is its row's position k - kv_indptr[i]
    kv_at = np.repeat(row0 - kv_indptr[:-1], seq_lens)
    kv_at += _arange(int(kv_indptr[-1]))
    kv_indices = flat.take(kv_at)
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


def next_decode_plan(prev: StepPlan, page_table: np.ndarray, input_ids: np.ndarray) -> StepPlan:
    """The decode step after decode step `prev`, for the same requests one token further:
    `build_step_plan(page_table, prev.slots, prev.seq_lens, 1, input_ids, every row, False)`,
    its KV read mapping being `prev.kv_indices` with each request's new location inserted
    after its run instead of gathered again. Valid while the page-table entries `prev` read
    are unchanged: a decode step only appends (the scheduler builds whole after a prefill)."""
    bs = prev.batch_size
    starts = prev.seq_lens
    rows = _arange(bs + 1)
    kv_indptr = (prev.kv_indptr + rows).astype(np.int32)
    flat_at = prev.slots.astype(np.int64) * page_table.shape[1] + starts
    out_loc = page_table.reshape(-1).take(flat_at)
    kv_indices = np.empty(int(kv_indptr[-1]), dtype=np.int32)
    new_at = kv_indptr[1:] - 1
    kv_indices[new_at] = out_loc
    old = np.ones(len(kv_indices), dtype=bool)
    old[new_at] = False
    kv_indices[old] = prev.kv_indices
    return StepPlan(
        is_prefill=False,
        slots=prev.slots,
        extend_lens=np.ones(bs, dtype=np.int32),
        seq_lens=starts + 1,
        kv_indptr=kv_indptr,
        input_ids=np.asarray(input_ids, dtype=np.int32),
        positions=starts.copy(),
        out_loc=out_loc,
        kv_indices=kv_indices,
        logits_indices=rows[:bs].astype(np.int32),
        sample_rows=rows[:bs].astype(np.int32),
    )
