"""The step loop over an in-process scheduler, at overlap depth 0 or 1.

Depth 0 (serial): schedule, run the step on the device, commit it. Depth 1 (overlap
scheduling): the CPU schedules step N+1 while the device runs step N. Each `step()`:
1. `schedule_ahead` step N+1 (its decode inputs still on the device are `-1`);
2. submit it to the `DeviceStream` (`DeviceStep`: the `-1` inputs are the last tokens sampled
   in their slots, on the device);
3. wait for step N's copy and `commit_oldest` it: its outputs are this call's result.
So at most two steps are in flight, and the scheduler's pipelined mode keeps what an
unconfirmed step reads: a request finished or aborted meanwhile keeps its slot and pages until
its last step is committed (`Scheduler.check_integrity` checks no read page is free).

What the sampler reads of a request is snapshotted when its step is submitted (a greedy row
without `min_tokens` or penalties reads only its immutable params): the number of its
outputs (committed + in flight: `min_tokens`, the noise counter of a seeded draw) and, for a
request with penalties, their values, which needs every earlier step committed: while such a
request has a sample in flight the loop commits before scheduling (no overlap then).

Depth 1 needs a backend with `schedule_ahead` / `commit_oldest` / `num_inflight` (the Python
`Scheduler`); the others, or `MINISGL_DISABLE_OVERLAP_SCHEDULING=1`, run at depth 0.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from minisgl.engine.stream import DeviceStream, InlineStream, StepHandle
from minisgl.runtime.device_step import DeviceStep
from minisgl.sampler import SampleResult, TokenLogprob
from minisgl.scheduler.backend import SampleView, ScheduledReq, SchedulerBackend
from minisgl.scheduler.request import DROPPED, StepOutput

ENV_DISABLE = "MINISGL_DISABLE_OVERLAP_SCHEDULING"


def overlap_disabled() -> bool:
    return os.environ.get(ENV_DISABLE, "").strip().lower() in ("1", "true", "yes", "on")


def pipelined(sched: object) -> bool:
    """The backend's class has the pipelined mode (a wrapper that forwards unknown attributes
    to an inner scheduler does not: its own `schedule` would be bypassed)."""
    return all(
        hasattr(type(sched), name) for name in ("schedule_ahead", "commit_oldest", "num_inflight")
    )


class AheadLike(Protocol):
    @property
    def plan(self) -> Any: ...
    @property
    def reqs(self) -> Sequence[Any]: ...


class CommitLike(Protocol):
    @property
    def outputs(self) -> Sequence[StepOutput]: ...


@runtime_checkable
class PipelinedBackend(Protocol):
    """The pipelined mode of a scheduler backend (see `scheduler.inflight`)."""

    def schedule_ahead(self) -> AheadLike | None: ...
    def commit_oldest(self, next_tokens: Sequence[int]) -> CommitLike: ...
    @property
    def num_inflight(self) -> int: ...


class _Outputs(Sequence[int]):
    """A request's outputs when some are still on the device: their count is known, their
    values are not (the sampler reads values only for penalties, which wait for them)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # type: ignore[override]
        raise LookupError("an output token is still on the device")

    def __iter__(self) -> Iterator[int]:
        raise LookupError("an output token is still on the device")


@dataclass(frozen=True)
class StepBatch:
    """Committed tokens, dropped ones left out: the outputs, the logprobs of each (None where
    not asked for), and by request id the errors of rows that failed alone."""

    outputs: list[StepOutput]
    logprobs: list[TokenLogprob | None]
    errors: dict[int, str]


EMPTY = StepBatch([], [], {})


def _row_logprobs(
    rows: Sequence[Any], logprobs: Sequence[TokenLogprob | None], outs: Sequence[StepOutput]
) -> list[TokenLogprob | None]:
    """Each output's logprobs: a request's outputs, in order, came from its sample rows in order
    (one row a request in a decode step; a speculative verify row per emitted token)."""
    per_rid: dict[int, deque[TokenLogprob | None]] = {}
    for row, lp in zip(rows, logprobs, strict=True):
        if lp is not None:
            per_rid.setdefault(row.rid, deque()).append(lp)
    if not per_rid:
        return [None] * len(outs)
    return [per_rid[o.rid].popleft() if per_rid.get(o.rid) else None for o in outs]


@dataclass
class _Step:
    handle: StepHandle
    rows: list[Any]  # the sample rows: a `SampleView`, or the request (greedy, no history)


class StepLoop:
    """Drives a scheduler backend and a `DeviceStep`: depth 0 commits each step it schedules,
    depth 1 keeps one step ahead on a `DeviceStream`."""

    def __init__(
        self,
        sched: SchedulerBackend,
        device: DeviceStep,
        stream: DeviceStream | None = None,
        depth: int = 0,
    ) -> None:
        if depth not in (0, 1):
            raise ValueError(f"overlap depth is 0 or 1, got {depth}")
        if depth and not pipelined(sched):
            raise ValueError(f"backend {sched.backend} has no pipelined mode (depth 0 only)")
        self.sched = sched
        self.device = device
        self.stream = stream if stream is not None else InlineStream()
        self.depth = depth
        self._steps: deque[_Step] = deque()
        self._pending: Counter[int] = Counter()  # rid -> samples in flight
        self._penalized: Counter[int] = Counter()  # rid with penalties -> samples in flight

    @property
    def num_inflight(self) -> int:
        return len(self._steps)

    def step(self) -> StepBatch | None:
        """One step; None: nothing committed (nothing to run, or a step just went ahead)."""
        if self.depth == 0:
            return self._serial()
        sched: Any = self.sched
        if self._penalized and self._steps:  # the sampler needs committed outputs
            return self._commit()
        ahead = sched.schedule_ahead()
        if ahead is not None:
            self._submit(ahead.plan, ahead.reqs)
        if len(self._steps) > (1 if ahead is not None else 0):
            return self._commit()
        return None

    def drain(self, fail: bool = False) -> list[StepBatch]:
        """Commit every step in flight; `fail`: a step whose device work raised commits as
        token 0 (the caller has aborted its requests: every token is dropped)."""
        done = []
        while self._steps:
            done.append(self._commit(fail))
        return done

    def close(self) -> None:
        self.stream.close()

    # ------------------------------------------------------------------ depth 0
    def _serial(self) -> StepBatch | None:
        planned = self.sched.schedule()
        if planned is None:
            return None
        plan, reqs = planned
        rows = [reqs[r] for r in plan.sample_rows.tolist()]
        res = self.device.run(plan, rows)
        outs = list(self.sched.commit(reqs, plan, res.tokens))
        return StepBatch(
            outs,
            _row_logprobs(rows, res.logprobs, outs),
            {r.rid: e for r, e in zip(rows, res.errors, strict=True) if e},
        )

    # ------------------------------------------------------------------ depth 1
    def _submit(self, plan: Any, reqs: Sequence[ScheduledReq]) -> None:
        rows: list[Any] = [reqs[r] for r in plan.sample_rows.tolist()]
        for k, req in enumerate(rows):
            if isinstance(req, SampleView):
                continue  # a snapshot already (a speculative verify row)
            p = req.params
            if p.is_greedy and not p.min_tokens and not p.needs_history:
                continue  # the sampler reads only its params (immutable): no snapshot
            rid = req.rid
            n = len(req.output_ids) + self._pending[rid]
            hist = tuple(req.output_ids) if p.needs_history else _Outputs(n)
            rows[k] = SampleView(rid, p, req.generator, req.input_ids, hist)
            self._pending[rid] += 1
            if p.needs_history:  # penalties, a grammar: the next sample needs this token
                self._penalized[rid] += 1
        handle = self.stream.submit(self.device.job(plan, rows))
        self._steps.append(_Step(handle, rows))

    def _commit(self, fail: bool = False) -> StepBatch:
        step = self._steps[0]
        try:
            res = step.handle.result()
        except Exception:
            if not fail:
                raise  # the step stays at the head: `drain(fail=True)` after aborting
            n = len(step.rows)
            res = SampleResult([0] * n, ["the device step failed"] * n, [None] * n)
        self._steps.popleft()
        for row in step.rows:
            if not isinstance(row, SampleView):
                continue
            for counter in (self._pending, self._penalized):
                if row.rid in counter:
                    counter[row.rid] -= 1
                    if counter[row.rid] <= 0:
                        del counter[row.rid]
        commit = self.sched.commit_oldest(res.tokens)  # type: ignore[attr-defined]
        row_lps = _row_logprobs(step.rows, res.logprobs, commit.outputs)
        row_errs = {r.rid: e for r, e in zip(step.rows, res.errors, strict=True) if e}
        outs, lps, errs = [], [], {}
        for out, lp in zip(commit.outputs, row_lps, strict=True):
            if out.finish_reason == DROPPED:
                continue
            outs.append(out)
            lps.append(lp)
            if out.rid in row_errs:
                errs[out.rid] = row_errs[out.rid]
        return StepBatch(outs, lps, errs)
