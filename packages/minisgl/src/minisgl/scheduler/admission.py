"""The admission part of the `Scheduler`: the waiting queue (FIFO or priority with aging),
admission with full reservation (prompt + max_tokens pages, prefix hits counted), chunked and
balanced prefill batches under `max_extend_tokens`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from itertools import compress
from typing import Any

import numpy as np

from minisgl.core import SamplingParams
from minisgl.scheduler.request import (
    Req,
    RequestError,
    pages,
    validate_request,
)
from minisgl.scheduler.state import SchedulerState


class Admission(SchedulerState):
    def add_request(
        self,
        input_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        rid: int | None = None,
        generator: Any = None,
        priority: int | None = None,
    ) -> int:
        """`priority`: its place in the waiting queue under priority scheduling (default: the
        params' `priority`)."""
        ids, max_total = validate_request(
            input_ids, params, self.max_seq_len, self.alloc.num_pages, self.page_size
        )
        rid = next(self._rids) if rid is None else rid
        if rid in self.requests:
            raise RequestError(f"duplicate request id {rid}")
        req = Req(rid, ids, params, max_total, generator=generator, table=self.table)
        req.fill_ids = ids
        self.requests[rid] = req
        self._enqueue(req, params.priority if priority is None else priority)
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
            if not self._admit(req, batch):
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

    def _computed_in_batch(
        self, fill: np.ndarray, cached: int, batch: list[tuple[Req, int]]
    ) -> bool:
        """Whether a request of `batch` computes at least `in_batch_prefix_min` of the tokens
        `fill` does not find cached (its first `cached` tokens): the shared prefix past it."""
        least = self.in_batch_prefix_min
        if not least or len(fill) - 1 - cached < least:
            return False
        mine = fill[: len(fill) - 1]
        for other, _ in batch:
            theirs = other.fill_ids[: len(other.fill_ids) - 1]
            n = min(len(mine), len(theirs))
            if n - cached < least:
                continue
            diff = np.flatnonzero(mine[:n] != theirs[:n])
            if (diff[0] if len(diff) else n) - cached >= least:
                return True
        return False

    def _admit(self, req: Req, batch: list[tuple[Req, int]]) -> bool:
        ps = self.page_size
        fill = req.fill_ids
        assert fill is not None
        match = self.cache.match_prefix(fill[: len(fill) - 1])
        self.cache.lock(match.node)
        if self._computed_in_batch(fill, match.length, batch):
            self.cache.unlock(match.node)
            return False
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
