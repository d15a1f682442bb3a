"""The in-flight part of the `Scheduler`: its pipelined mode (`schedule_ahead` /
`commit_oldest` / `retire`, the reference of the Rust core's `sched::pipeline`; see
`scheduler.scheduler` for the rules)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from minisgl.kvcache import RadixCache
from minisgl.scheduler.admission import Admission
from minisgl.scheduler.backend import ScheduledStep
from minisgl.scheduler.decode import Decode, rows_of
from minisgl.scheduler.request import (
    FINISH_REASONS,
    Req,
    StepOutput,
)
from minisgl.scheduler.state import Inflight
from minisgl.step.plan import StepPlan


@dataclass(frozen=True)
class AheadStep:
    """A step `schedule_ahead` scheduled (`plan.input_ids` holds `-1` where a decode input is
    still in flight)."""

    step: int  # 0, 1, 2... in schedule order; commits come back in the same order
    plan: StepPlan
    reqs: list[Req]  # batch order
    batch_pos: np.ndarray  # position of each batch request in the running list
    admitted: int  # requests admitted by this step: the last `admitted` of `running` (a
    # balanced prefill step may leave some out of its batch)


@dataclass(frozen=True)
class AheadCommit:
    """What `commit_oldest` did: one output per sample row (`finish_reason` None, "stop",
    "length" or `DROPPED`) and `(sample position, generated ids)` of each finished request."""

    step: int
    outputs: list[StepOutput]
    finished: list[tuple[int, list[int]]]


class InFlight(Admission, Decode):
    def schedule_ahead(self) -> AheadStep | None:
        """Schedule the next step while earlier ones may be unconfirmed (see the module
        docs); None when no row can run before a commit (or there is no work)."""
        t0 = time.perf_counter()
        self._served["schedule"] += 1
        n_waiting = len(self.waiting)
        batch = self._schedule_prefill()
        run = self._running_slots()
        keep: np.ndarray | None = None
        if batch:
            step = self._prefill_plan(batch)
        else:
            keep = ~self.table.length_certain(run)
            step = self._decode_plan(None if keep.all() else keep)
        if step is None:
            return None
        self._clock += 1
        ahead = self._go_ahead(step, run, keep, n_waiting)
        self.stats.schedule_s.append(time.perf_counter() - t0)
        return ahead

    def _go_ahead(
        self, step: ScheduledStep, run: np.ndarray, keep: np.ndarray | None, n_waiting: int
    ) -> AheadStep:
        """Register a planned step as in flight: its KV lengths and samples counted ahead, the
        prefix cache given its prompts (`run`: the running slots before it; `keep`: a decode
        step's running requests that got a row, None for a prefill)."""
        plan, reqs = step.plan, list(step.reqs)
        t = self.table
        slots = plan.slots
        if plan.is_prefill:
            where = np.zeros(self.alloc.max_slots, dtype=np.int32)  # slot -> running position
            where[run] = np.arange(len(run), dtype=np.int32)
            batch_pos = where[slots]
        else:  # the running requests that got a row
            assert keep is not None
            batch_pos = np.flatnonzero(keep).astype(np.int32)
        t.kv_len[slots] += plan.extend_lens
        t.inflight[slots] += 1
        t.pending_out[slots[plan.sample_rows]] += 1
        deferred: list[np.ndarray] = []
        if plan.is_prefill and isinstance(self.cache, RadixCache):
            for req in reqs:
                self._cache_prefix(req, deferred)
        sid = self._next_step
        self._next_step += 1
        self._inflight.append(
            Inflight(sid, reqs, slots, plan.sample_rows, plan.kv_indices, deferred)
        )
        return AheadStep(sid, plan, reqs, batch_pos, n_waiting - len(self.waiting))

    def commit_oldest(self, next_tokens: Sequence[int]) -> AheadCommit:
        """Commit the oldest unconfirmed step with one token per sample row (module docs)."""
        if not self._inflight:
            raise RuntimeError("commit_oldest without a step in flight")
        st = self._inflight[0]
        if len(next_tokens) != len(st.sample_rows):
            raise ValueError(
                f"commit got {len(next_tokens)} tokens for {len(st.sample_rows)} samples"
            )
        t0 = time.perf_counter()
        self._served["commit"] += 1
        self._inflight.popleft()
        for dup in st.deferred_free:
            self.alloc.free_locations(dup)
        t = self.table
        rows = st.sample_rows
        slots = st.slots if len(rows) == len(st.slots) else st.slots[rows]
        t.pending_out[slots] -= 1
        # a request holding a slot is done (finished or retired) iff it is retiring
        live = ~t.done[slots] if self._retiring else None
        row_reqs = rows_of(st.reqs, rows)
        tokens = np.asarray(next_tokens, dtype=np.int64).reshape(-1)
        codes = self._append_tokens(row_reqs, slots, tokens, live)
        outputs = self._outputs(slots, tokens, codes)
        finished: list[tuple[int, list[int]]] = []
        ends = () if codes is None else np.flatnonzero((codes > 0) & (codes < 3)).tolist()
        for k in ends:  # finished, in row order
            req = row_reqs[k]
            req.finish_reason = FINISH_REASONS[codes[k]]
            t.done[req.slot] = True
            finished.append((k, req.output_ids))
            self._leave_running(req)
            del self.requests[req.rid]
            self._retiring.append(req)
        t.inflight[st.slots] -= 1
        if self._retiring:
            gone = (t.inflight[st.slots] == 0) & t.done[st.slots]
            for i in np.flatnonzero(gone).tolist():  # in batch order
                req = st.reqs[i]
                self._retiring.remove(req)
                self._release(req)
        self.stats.commit_s.append(time.perf_counter() - t0)
        self.stats.steps += 1
        self.stats.generated_tokens += len(tokens) if live is None else int(live.sum())
        return AheadCommit(st.step, outputs, finished)

    def retire(self, rid: int, abort: bool) -> bool:
        """Finish a request from outside the step loop (`abort`, or a stop string): at once
        when no unconfirmed step contains it, else when the last one is committed."""
        return self.finish(rid, "abort" if abort else "stop")

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @property
    def num_retiring(self) -> int:
        return len(self._retiring)
