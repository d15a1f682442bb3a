"""Continuous batching with chunked prefill and a prefix cache.

Each step is either a prefill step (admit / continue prompts under `max_extend_tokens`) or a
decode step (one token for every running request). Admission reserves, for every admitted
request, the pages it can still need (prompt + max_tokens), so decode never runs out of KV.

Unfinished requests are cached as soon as they are prefilled ("cache unfinished request"):
`commit` of a prefill step inserts every batch request's page-aligned computed prefix into the
radix cache (see `Scheduler._cache_prefix` for the exact order of operations, which the Rust
core mirrors), so a request admitted while an earlier one with the same prefix is still
running reuses its KV. A request always owns exactly `[cache_len, alloc_len)` of its row.

In-batch prefix check: admission stops (FIFO) at a request whose prompt, past its own cache
hit, shares `in_batch_prefix_min` or more tokens with a request of the batch being built; the
next step finds them cached (SGLang's check, so a burst on one long system prompt computes it
once). 0 turns it off.

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

import time

import numpy as np

from minisgl.scheduler.backend import ScheduledStep
from minisgl.scheduler.inflight import AheadCommit, AheadStep, InFlight

__all__ = ["AheadCommit", "AheadStep", "Scheduler"]


class Scheduler(InFlight):
    """The Python reference scheduler (the `python` backend; a `SchedulerBackend`): its
    admission, decode, prefix cache and in-flight parts on one state (`scheduler.state`)."""

    backend = "python"

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

    def check_integrity(self) -> None:
        """Every page is exactly one of: free, owned by the cache, owned by a live request
        (running, or retired and waiting for its unconfirmed steps), or waiting to be freed
        when an unconfirmed step is committed; no page an unconfirmed step reads is free."""
        ps = self.page_size
        pages = self.alloc.num_pages
        free_list = self.alloc._free_pages
        free = np.fromiter(free_list, dtype=np.int64, count=len(free_list))
        held = [free, self.cache.all_indices()[::ps] // ps]  # one bincount: np.add.at was 5x
        for req in [*self.running, *self._retiring]:  # slower (8 ms at 115k pages, idle edge)
            own = self.alloc.page_table[req.slot, req.cache_len : req.alloc_len]
            held.append(own[::ps] // ps)
        for st in self._inflight:
            held.extend(dup[::ps] // ps for dup in st.deferred_free)
        owners = np.bincount(np.concatenate([h.astype(np.int64) for h in held]), minlength=pages)
        if len(owners) > pages:
            raise AssertionError(f"KV integrity: page {len(owners) - 1} is past the pool's {pages}")
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
