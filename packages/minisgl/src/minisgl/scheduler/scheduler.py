"""Continuous batching with chunked prefill and a prefix cache.

Each step is either a prefill step (admit / continue prompts under `max_extend_tokens`) or a
decode step (one token for every running request). Admission reserves, for every admitted
request, the pages it can still need (prompt + max_tokens), so decode never runs out of KV.

Unfinished requests are cached as soon as they are prefilled ("cache unfinished request"):
`commit` of a prefill step inserts every batch request's page-aligned computed prefix into the
radix cache (see `Scheduler._cache_prefix` for the exact order of operations, which the Rust
core mirrors), so a request admitted while an earlier one with the same prefix is still
running reuses its KV. A request always owns exactly `[cache_len, alloc_len)` of its row.

Balanced prefill steps: a prefill step that spends its whole budget B while 0 < R < B prompt
tokens are left for the next one is cut to `ceil((B + R) / 2)` tokens, so the two are even
rather than a full step and a small tail (on a CPU a small step costs more per token:
many-short's 4096 + 1077-token steps took 0.73 s, 2587 + 2586 0.64 s). R counts the rest of
the prompts in the step, the running prompts left out of it and, up to the free slots, the
waiting prompts in full (prefix hits are not looked up: R may be over-counted, which only
cuts less). The cut keeps batch order; requests admitted past it stay admitted with no tokens
in this step and continue first in the next. It never adds a step where the next one's
admissions succeed: the next step then gets at most `B + R - ceil((B + R) / 2) <= B` tokens.

Pipelined mode (`schedule_ahead` / `commit_oldest` / `retire`, the reference of the Rust
core's `sched::pipeline`, decision for decision): steps are scheduled while earlier ones are
unconfirmed. `schedule_ahead` makes `schedule`'s decisions and applies at once what `commit`
does without the sampled tokens (KV lengths advance; on a prefill step prefixes are cached,
the duplicate pages that drops being freed only when the step is committed); a decode input
still in flight is `-1` (the worker feeds its own last sampled token of that request), and a
request whose committed plus in-flight samples reach a length limit gets no decode row.
`commit_oldest` commits the oldest step: (1) free the step's deferred duplicates, run by run;
(2) per sample row: append + finish rules, or `DROPPED` for a request already finished or
retired (its token is not appended); (3) per batch request in batch order: one step fewer in
flight, and a finished / retired request with none left is released. A request finished or
retired while a later unconfirmed step contains it leaves `running` and `requests` at once
but keeps its slot, pages and cache lock until then. One step in flight at a time is exactly
`schedule` + `commit`.

Per-request state a step reads and advances (KV / allocated / cached lengths, outputs, last
token, in-flight counters, finish limits) lives in `slots.SlotTable`, one row per page-table
slot (`Req.kv_len` ... read it), so a decode step is whole-batch numpy on the running slots:
no per-request Python loop (a request's `output_ids` are read from its row on demand).

Priority scheduling (`priority_aging_steps=K`; off, i.e. FIFO, when None): `add_request(...,
priority=p)`, a lower number is served first (vLLM's convention). The waiting queue is kept
sorted by `p * K + clock` (`clock`: steps scheduled so far), new requests going after the
equal keys, so the order is FIFO within a priority and a waiting request gains one level
every K steps (aging). Bound: a request of priority p is never overtaken by one of priority
q that arrives `(p - q) * K` or more steps after it, so it waits at most for the requests
that arrived before it or within `(p - q_min) * K` steps after it. Admission is unchanged
(the head of the queue, stopping at the first refusal); the Rust core orders the same way.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter
from typing import Any

import numpy as np

from minisgl.core import SamplingParams
from minisgl.kvcache import RadixCache, create_prefix_cache
from minisgl.kvcache.allocator import PageAllocator
from minisgl.scheduler.backend import ScheduledStep
from minisgl.scheduler.cpu_backend import served_counter
from minisgl.scheduler.plan import StepPlan, build_step_plan, next_decode_plan
from minisgl.scheduler.request import (
    DROPPED,
    FINISH_REASONS,
    Req,
    RequestError,
    StepOutput,
    pages,
    step_outputs,
    validate_request,
)
from minisgl.scheduler.slots import SlotTable
from minisgl.scheduler.stats import KvUsage, SchedulerStats


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


@dataclass(frozen=True)
class _Inflight:
    step: int
    reqs: list[Req]
    slots: np.ndarray  # of `reqs`
    sample_rows: np.ndarray
    reads: np.ndarray  # every KV location the step reads or writes
    deferred_free: list[np.ndarray]  # duplicate location runs to free on commit


class Scheduler:
    """The Python reference scheduler (the `python` backend; a `SchedulerBackend`)."""

    backend = "python"

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_seq_len: int,
        max_running_requests: int,
        max_extend_tokens: int,
        cache_type: str,
        eos_token_ids: Sequence[int] = (),
        priority_aging_steps: int | None = None,
    ) -> None:
        if priority_aging_steps is not None and (
            isinstance(priority_aging_steps, bool)
            or not isinstance(priority_aging_steps, int)
            or priority_aging_steps <= 0
        ):
            raise ValueError(
                f"priority_aging_steps must be a positive int or None, got {priority_aging_steps!r}"
            )
        self.priority_aging_steps = priority_aging_steps
        self._clock = 0  # steps scheduled so far (the priority aging clock)
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self.max_running = max_running_requests
        self.max_extend_tokens = max_extend_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self._eos = sorted(self.eos_token_ids)
        self.alloc = PageAllocator(num_pages, page_size, max_running_requests, max_seq_len)
        self.table = SlotTable.empty(max_running_requests, max_seq_len)
        self.cache = create_prefix_cache(cache_type, page_size)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted, in admission order (prefilling or decoding)
        self._run_slots: np.ndarray | None = None  # slots of `running` (None: recompute)
        self._last_decode: StepPlan | None = None  # the last step, while it was a decode step
        self.requests: dict[int, Req] = {}
        self.stats = SchedulerStats()
        self._rids = itertools.count()
        self._served = served_counter("python")
        self._inflight: deque[_Inflight] = deque()  # pipelined mode
        self._retiring: list[Req] = []  # finished / retired, waiting for unconfirmed steps
        self._next_step = 0

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        input_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        rid: int | None = None,
        generator: Any = None,
        priority: int = 0,
    ) -> int:
        ids, max_total = validate_request(
            input_ids, params, self.max_seq_len, self.alloc.num_pages, self.page_size
        )
        rid = next(self._rids) if rid is None else rid
        if rid in self.requests:
            raise RequestError(f"duplicate request id {rid}")
        req = Req(rid, ids, params, max_total, generator=generator, table=self.table)
        req.fill_ids = ids
        self.requests[rid] = req
        self._enqueue(req, priority)
        return rid

    def _enqueue(self, req: Req, priority: int) -> None:
        """FIFO, or (priority mode) after every waiting request whose key is <= its own."""
        k = self.priority_aging_steps
        if k is None:
            self.waiting.append(req)
            return
        req.sched_key = int(priority) * k + self._clock
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].sched_key > req.sched_key:
            i -= 1
        self.waiting.insert(i, req)

    def abort(self, rid: int) -> bool:
        """Finish a request now (client gone, stop string hit...); frees all it holds."""
        return self.finish(rid, "abort")

    def finish(self, rid: int, reason: str) -> bool:
        req = self.requests.get(rid)
        if req is None:
            return False
        req.finish_reason = reason
        if req.slot >= 0:
            self.table.done[req.slot] = True
            self._leave_running(req)
            if req.inflight > 0:  # pipelined: released when its last step is committed
                del self.requests[rid]
                self._retiring.append(req)
                return True
            self._release(req)
        else:
            self.waiting.remove(req)
        del self.requests[rid]
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ScheduledStep | None:
        if self._inflight:
            raise RuntimeError("schedule with pipelined steps in flight (use schedule_ahead)")
        t0 = time.perf_counter()
        self._served["schedule"] += 1
        batch = self._schedule_prefill()
        plan = self._prefill_plan(batch) if batch else self._decode_plan()
        self._clock += plan is not None
        self.stats.schedule_s.append(time.perf_counter() - t0)
        return plan

    def commit(
        self, reqs: Sequence[Req], plan: StepPlan, next_tokens: Sequence[int]
    ) -> list[StepOutput]:
        """Advance KV lengths, cache prefilled prefixes, append sampled tokens, finish and
        release requests.

        Order: (1) `kv_len += extend_len` for every batch request; (2) on a prefill step with
        the radix cache, `_cache_prefix` for every batch request in batch order; (3) per sample
        row in order: append the token, apply the finish rules, release a finished request
        (done as: every row's append and rules at once, then the releases in row order, which
        decides the same: the rules read no allocator or cache state).
        """
        t0 = time.perf_counter()
        self._served["commit"] += 1
        rows = plan.sample_rows
        if len(next_tokens) != len(rows):
            raise ValueError(f"commit got {len(next_tokens)} tokens for {len(rows)} samples")
        if len(reqs) != plan.batch_size:
            raise ValueError(f"commit got {len(reqs)} requests for a batch of {plan.batch_size}")
        self.table.kv_len[plan.slots] += plan.extend_lens
        if plan.is_prefill and isinstance(self.cache, RadixCache):
            for req in reqs:
                self._cache_prefix(req)
        row_reqs = _rows_of(reqs, rows)
        tokens = np.asarray(next_tokens, dtype=np.int64).reshape(-1)
        slots = plan.slots[rows]
        codes = self._append_tokens(row_reqs, slots, tokens, None)
        outputs = self._outputs(slots, tokens, codes)
        for k in () if codes is None else np.flatnonzero(codes).tolist():  # in row order
            req = row_reqs[k]
            req.finish_reason = FINISH_REASONS[codes[k]]
            self._leave_running(req)
            self._release(req)
            del self.requests[req.rid]
        self.stats.commit_s.append(time.perf_counter() - t0)
        self.stats.steps += 1
        self.stats.generated_tokens += len(outputs)
        return outputs

    def _append_tokens(
        self,
        row_reqs: Sequence[Req],
        slots: np.ndarray,
        tokens: np.ndarray,
        live: np.ndarray | None,
    ) -> np.ndarray | None:
        """Append each sample row's token to its request (`live`: the rows to append, None for
        all) and return the rows' finish codes (`FINISH_REASONS` indices, `DROPPED` where not
        live), None when every row goes on.

        The finish rules, in order: a stop token or (unless `ignore_eos`) an EOS id is "stop";
        `max_tokens` outputs or `max_total_len` tokens in all is "length"."""
        t = self.table
        n_out = t.out_len[slots]
        length = n_out >= t.out_limit[slots] - 1
        stop: np.ndarray | None = None
        for eos in self._eos:  # a few ids: cheaper than np.isin
            stop = tokens == eos if stop is None else stop | (tokens == eos)
        if stop is not None:
            stop &= t.eos_stops[slots]
        has_stop = t.has_stop[slots]
        if has_stop.any():
            stop = np.zeros(len(tokens), dtype=bool) if stop is None else stop
            for k in np.flatnonzero(has_stop).tolist():
                stop[k] |= int(tokens[k]) in row_reqs[k].params.stop_token_ids
        if live is None:
            t.append(slots, tokens, n_out)
        else:
            t.append(slots[live], tokens[live], n_out[live])
        ends = length if stop is None else length | stop
        if live is not None:
            ends = ends | ~live
        if not ends.any():
            return None
        codes = length.astype(np.int8) * np.int8(2)
        if stop is not None:
            codes[stop] = 1
        if live is not None:
            codes[~live] = FINISH_REASONS.index(DROPPED)
        return codes

    def _outputs(
        self, slots: np.ndarray, tokens: np.ndarray, codes: np.ndarray | None
    ) -> list[StepOutput]:
        """The outputs of sample rows in `slots` (read before any of them is released)."""
        if codes is None:
            reasons: Sequence[str | None] = [None] * len(tokens)
        else:
            reasons = list(map(FINISH_REASONS.__getitem__, codes.tolist()))
        return step_outputs(self.table.rid[slots].tolist(), tokens.tolist(), reasons)

    # ------------------------------------------------------------------ pipelined mode
    def schedule_ahead(self) -> AheadStep | None:
        """Schedule the next step while earlier ones may be unconfirmed (see the module
        docs); None when no row can run before a commit (or there is no work)."""
        t0 = time.perf_counter()
        self._served["schedule"] += 1
        n_waiting = len(self.waiting)
        batch = self._schedule_prefill()
        run = self._running_slots()
        if batch:
            step = self._prefill_plan(batch)
        else:
            keep = ~self.table.length_certain(run)
            step = self._decode_plan(None if keep.all() else keep)
        if step is None:
            return None
        self._clock += 1
        plan, reqs = step.plan, list(step.reqs)
        t = self.table
        slots = plan.slots
        if plan.is_prefill:
            where = np.zeros(self.alloc.max_slots, dtype=np.int32)  # slot -> running position
            where[run] = np.arange(len(run), dtype=np.int32)
            batch_pos = where[slots]
        else:  # the running requests that got a row
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
            _Inflight(sid, reqs, slots, plan.sample_rows, plan.kv_indices, deferred)
        )
        self.stats.schedule_s.append(time.perf_counter() - t0)
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
        row_reqs = _rows_of(st.reqs, rows)
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

    # ------------------------------------------------------------------ running list
    def _running_slots(self) -> np.ndarray:
        """The slots of `running`, in its order (cached until `running` changes)."""
        if self._run_slots is None:
            self._run_slots = np.array(list(map(attrgetter("slot"), self.running)), np.int64)
        return self._run_slots

    def _join_running(self, req: Req) -> None:
        self.running.append(req)
        self._run_slots = None

    def _leave_running(self, req: Req) -> None:
        self.running.remove(req)
        self._run_slots = None

    # ------------------------------------------------------------------ admission
    def _reserved_pages(self) -> int:
        """Pages admitted requests may still allocate (up to their max_total_len)."""
        ps, t, run = self.page_size, self.table, self._running_slots()
        return int((-(-t.max_total_len[run] // ps) - t.alloc_len[run] // ps).sum())

    def _schedule_prefill(self) -> list[tuple[Req, int]]:
        budget = self.max_extend_tokens
        batch: list[tuple[Req, int]] = []
        left_out = 0  # prompt tokens of running requests the budget leaves out
        run, t = self._running_slots(), self.table
        prefilling = t.kv_len[run] < t.fill_len[run]
        for req in compress(self.running, prefilling) if prefilling.any() else ():
            # chunked prompts continue first
            if budget <= 0:
                left_out += req.prefill_len - req.kv_len
                continue
            n = min(req.prefill_len - req.kv_len, budget)
            batch.append((req, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            if not self._admit(req):
                break
            self.waiting.popleft()
            self._join_running(req)
            n = min(req.prefill_len - req.kv_len, budget)
            batch.append((req, n))
            budget -= n
        if budget == 0:
            batch = self._balanced(batch, left_out)
        if batch:
            slots = np.array([r.slot for r, _ in batch], dtype=np.int64)
            self._ensure_capacity(slots, t.kv_len[slots] + [n for _, n in batch])
        return batch

    def _balanced(self, batch: list[tuple[Req, int]], left_out: int) -> list[tuple[Req, int]]:
        """A step that spent its whole budget, cut to even out with the next one (balanced
        prefill steps, see the module docstring)."""
        full = self.max_extend_tokens
        rest = left_out + sum(r.prefill_len - r.kv_len - n for r, n in batch)
        for req in itertools.islice(self.waiting, max(self.max_running - len(self.running), 0)):
            if rest >= full:
                break
            rest += req.prefill_len
        if rest == 0 or rest >= full:
            return batch
        target, cut = (full + rest + 1) // 2, []
        for req, n in batch:
            if target == 0:
                break
            cut.append((req, min(n, target)))
            target -= cut[-1][1]
        return cut

    def _admit(self, req: Req) -> bool:
        ps = self.page_size
        fill = req.fill_ids
        assert fill is not None
        match = self.cache.match_prefix(fill[: len(fill) - 1])
        self.cache.lock(match.node)
        need = pages(req.max_total_len, ps) - match.length // ps
        avail = self.alloc.num_free_pages + self.cache.evictable_size // ps - self._reserved_pages()
        if need > avail or self.alloc.num_free_slots == 0:
            self.cache.unlock(match.node)
            return False
        req.slot = self.alloc.alloc_slot()
        m = match.length
        self.alloc.page_table[req.slot, :m] = match.indices
        p = req.params
        self.table.admit(req.slot, req.rid, m, len(fill), len(req.input_ids), req.saved_output_ids,
                         p.max_tokens, req.max_total_len, p.ignore_eos,
                         bool(p.stop_token_ids))  # fmt: skip
        req.cache_node = match.node
        if not req.saved_output_ids:
            req.cached_tokens = m
            self.stats.prompt_tokens += len(fill)
            self.stats.cached_prompt_tokens += m
        return True

    def _ensure_capacity(self, slots: np.ndarray, lengths: np.ndarray) -> None:
        """Give each request of `slots` KV locations up to `lengths`, in order (evicting from
        the prefix cache only when the free pages run out)."""
        ps, t = self.page_size, self.table
        alloc = t.alloc_len[slots]  # page aligned
        grow = alloc < lengths
        if not grow.all():
            if not grow.any():
                return
            slots, alloc, lengths = slots[grow], alloc[grow], lengths[grow]
        need = (lengths - alloc + ps - 1) // ps
        if int(need.sum()) > self.alloc.num_free_pages:  # one at a time, evicting as it goes
            for slot, n in zip(slots.tolist(), need.tolist(), strict=True):
                short = n - self.alloc.num_free_pages
                if short > 0:
                    self.alloc.free_locations(self.cache.evict(short * ps))
                self.alloc.alloc_pages(slot, int(t.alloc_len[slot]), n)
                t.alloc_len[slot] += n * ps
            return
        self.alloc.alloc_pages_batch(slots, alloc, need)
        t.alloc_len[slots] = alloc + need * ps

    # ------------------------------------------------------------------ plans
    def _prefill_plan(self, batch: list[tuple[Req, int]]) -> ScheduledStep:
        reqs = [r for r, _ in batch]
        starts = np.array([r.kv_len for r in reqs], dtype=np.int32)
        lens = np.array([n for _, n in batch], dtype=np.int32)
        ids = np.concatenate([r.fill_ids[r.kv_len : r.kv_len + n] for r, n in batch])
        sample = starts + lens == np.array([r.prefill_len for r in reqs])
        slots = np.array([r.slot for r in reqs], dtype=np.int32)
        plan = build_step_plan(self.alloc.page_table, slots, starts, lens, ids, sample, True)
        self._last_decode = None
        return ScheduledStep(plan, reqs)

    def _decode_plan(self, keep: np.ndarray | None = None) -> ScheduledStep | None:
        """One token for every running request (`keep`: a mask of those that get one,
        pipelined mode). The input is the last output token, -1 while it is in flight."""
        slots = self._running_slots()
        reqs = list(self.running) if keep is None else list(compress(self.running, keep))
        if keep is not None:
            slots = slots[keep]
        if not reqs:
            return None
        t = self.table
        starts = t.kv_len[slots]
        self._ensure_capacity(slots, starts + 1)
        ids = np.where(t.pending_out[slots] > 0, -1, t.last_token[slots])
        prev = self._last_decode
        if (
            prev is not None
            and np.array_equal(prev.slots, slots)
            and np.array_equal(prev.seq_lens, starts)
        ):  # the same requests one token further: extend its KV read mapping
            plan = next_decode_plan(prev, self.alloc.page_table, ids)
        else:
            n = len(reqs)
            plan = build_step_plan(
                self.alloc.page_table, slots, starts, np.ones(n, dtype=np.int32), ids,
                np.ones(n, dtype=bool), False,
            )  # fmt: skip
        self._last_decode = plan
        return ScheduledStep(plan, reqs)

    # ------------------------------------------------------------------ caching
    def _cache_prefix(self, req: Req, defer: list[np.ndarray] | None = None) -> None:
        """Hand the computed page-aligned prefix of a running request to the radix cache.

        With `aligned = kv_len // page_size * page_size`, nothing happens unless
        `aligned > cache_len`. Otherwise, in this exact order (it fixes the logical clock, the
        node ids and the allocator's free stack, which the Rust core reproduces):
        1. `present = cache.insert(fill_ids[:aligned], row[:aligned])` (one clock tick; the
           cache takes `row[present:aligned]`);
        2. `match = cache.match_prefix(fill_ids[:aligned])` (one clock tick; ends at `aligned`,
           never splits since the insert already ended a node there);
        3. if `present > cache_len`: `row[cache_len:present]` were duplicates of KV another
           request inserted meanwhile: remember them, write `match.indices[cache_len:present]`
           into the row, then `free_locations(duplicates)`;
        4. `cache.lock(match.node)`, then `cache.unlock(old cache_node)` (lock first, so the
           shared path never drops to ref 0);
        5. `cache_node = match.node`, `cache_len = aligned`.
        `present >= cache_len` always holds: `[0, cache_len)` is locked in the cache. With
        `defer` (pipelined mode) the duplicates are appended there instead of freed.
        """
        ps = self.page_size
        aligned = req.kv_len // ps * ps
        if aligned <= req.cache_len:
            return
        fill = req.fill_ids
        assert fill is not None
        row = self.alloc.page_table[req.slot]
        tokens = fill[:aligned]
        present = self.cache.insert(tokens, row[:aligned].copy())
        match = self.cache.match_prefix(tokens)
        assert match.length == aligned and present >= req.cache_len
        if present > req.cache_len:
            dup = row[req.cache_len : present].copy()
            row[req.cache_len : present] = match.indices[req.cache_len : present]
            if defer is None:
                self.alloc.free_locations(dup)
            else:
                defer.append(dup)
        self.cache.lock(match.node)
        self.cache.unlock(req.cache_node)
        req.cache_node = match.node
        req.cache_len = aligned

    # ------------------------------------------------------------------ release
    def _release(self, req: Req) -> None:
        """Free a request's slot and pages, its computed page-aligned KV going to the cache
        (only the cached prefix on abort). Pipelined, `kv_len` may count a position whose
        token was dropped: the insert is clamped to the known tokens."""
        ps, slot = self.page_size, req.slot
        row = self.alloc.page_table[slot]
        all_tokens = req.all_tokens()
        known = min(req.kv_len, len(all_tokens))
        aligned = known // ps * ps if req.finish_reason != "abort" else req.cache_len
        tokens = all_tokens[:aligned]
        present = self.cache.insert(tokens, row[:aligned].copy())
        # [cache_len, present): duplicates of KV the cache already holds; [aligned, alloc): tail
        self.alloc.free_locations(row[req.cache_len : present])
        self.alloc.free_locations(row[max(aligned, present) : req.alloc_len])
        self.cache.unlock(req.cache_node)
        self.alloc.free_slot(slot)
        req.saved_output_ids = req.output_ids
        req.slot, req.cache_node = -1, None  # its lengths read 0 from now on

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Every page is exactly one of: free, owned by the cache, owned by a live request
        (running, or retired and waiting for its unconfirmed steps), or waiting to be freed
        when an unconfirmed step is committed; no page an unconfirmed step reads is free."""
        ps = self.page_size
        owners = np.zeros(self.alloc.num_pages, dtype=np.int32)
        free = np.array(self.alloc._free_pages, dtype=np.int64)
        np.add.at(owners, free, 1)
        np.add.at(owners, self.cache.all_indices()[::ps] // ps, 1)
        for req in [*self.running, *self._retiring]:
            own = self.alloc.page_table[req.slot, req.cache_len : req.alloc_len]
            np.add.at(owners, own[::ps] // ps, 1)
        for st in self._inflight:
            for dup in st.deferred_free:
                np.add.at(owners, dup[::ps] // ps, 1)
        bad = np.flatnonzero(owners != 1)
        if len(bad):
            raise AssertionError(
                f"KV integrity: {len(bad)} pages with owner count != 1, e.g. page {int(bad[0])} "
                f"owned {int(owners[bad[0]])} times"
            )
        self.cache.check_integrity()
        if len(self.running) + len(self._retiring) + self.alloc.num_free_slots != (
            self.alloc.max_slots
        ):
            raise AssertionError("KV integrity: request slots leaked")
        is_free = np.zeros(self.alloc.num_pages, dtype=bool)
        is_free[free] = True
        for st in self._inflight:
            read = st.reads.astype(np.int64) // ps
            read_free = read[is_free[read]]
            if len(read_free):
                raise AssertionError(
                    f"KV integrity: page {int(read_free[0])} is free but read by unconfirmed "
                    f"step {st.step}"
                )

    def kv_usage(self) -> KvUsage:
        return {
            "total_pages": self.alloc.num_pages,
            "free_pages": self.alloc.num_free_pages,
            "cached_tokens": self.cache.evictable_size + self.cache.protected_size,
            "running": len(self.running),
            "waiting": len(self.waiting),
        }


def _rows_of(reqs: Sequence[Req], rows: np.ndarray) -> Sequence[Req]:
    """The request of each sample row (all of them, in order, on a decode step)."""
    if len(rows) == len(reqs):  # rows are increasing: every request samples
        return reqs
    return [reqs[r] for r in rows.tolist()]
