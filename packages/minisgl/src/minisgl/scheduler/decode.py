"""The step part of the `Scheduler`: prefill and decode plans (a decode step is whole-batch
numpy on the running slots, extending the last decode plan when it can), and `commit`: KV
lengths, prefixes cached, sampled tokens appended under the finish rules, finished requests
released."""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import compress

import numpy as np

from minisgl.kvcache import RadixCache
from minisgl.scheduler.backend import ScheduledStep
from minisgl.scheduler.prefix_cache import PrefixCache
from minisgl.scheduler.request import (
    DROPPED,
    FINISH_REASONS,
    Req,
    StepOutput,
    step_outputs,
)
from minisgl.step.plan import StepPlan, build_step_plan, next_decode_plan


class Decode(PrefixCache):
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
        row_reqs = rows_of(reqs, rows)
        tokens = np.asarray(next_tokens, dtype=np.int64).reshape(-1)
        slots = plan.slots[rows]
        codes = self._append_tokens(row_reqs, slots, tokens, None)
        outputs = self._outputs(slots, tokens, codes)
        if codes is not None:
            self._finish_rows(row_reqs, codes)
        return self._close_step(t0, outputs)

    def _finish_rows(self, row_reqs: Sequence[Req], codes: np.ndarray) -> None:
        """End the requests whose finish code is set (in row order): their reason, out of the
        running set, their pages released."""
        for k in np.flatnonzero(codes).tolist():
            req = row_reqs[k]
            req.finish_reason = FINISH_REASONS[codes[k]]
            self._leave_running(req)
            self._release(req)
            del self.requests[req.rid]

    def _close_step(self, t0: float, outputs: list[StepOutput]) -> list[StepOutput]:
        """A committed step's counters; returns its outputs."""
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


def rows_of(reqs: Sequence[Req], rows: np.ndarray) -> Sequence[Req]:
    """The request of each sample row (all of them, in order, on a decode step)."""
    if len(rows) == len(reqs):  # rows are increasing: every request samples
        return reqs
    return [reqs[r] for r in rows.tolist()]
