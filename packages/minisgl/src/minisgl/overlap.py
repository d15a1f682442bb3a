"""Overlap scheduling in-process: the CPU schedules step N+1 while the device runs step N.

Each `OverlapLoop.step()`:
1. `schedule_ahead` step N+1 (its decode inputs still on the device are `-1`), and the host
   work of its inputs (which inputs are unknown, in which page-table slot);
2. submit it to the `DeviceStream`: on the device, each `-1` input is filled by index from
   `last_tokens[slot]` (the last token sampled in that slot, a device tensor written by every
   step), then forward, sample, `last_tokens[sample slots] = tokens`, one async copy of the
   tokens to the host;
3. wait for step N's copy and `commit_oldest` it: its outputs are this call's result.
So at most two steps are in flight, and the scheduler's pipelined mode keeps what an
unconfirmed step reads: a request finished or aborted meanwhile keeps its slot and pages until
its last step is committed (`Scheduler.check_integrity` checks no read page is free).

What the sampler reads of a request is snapshotted when its step is submitted (a greedy row
without `min_tokens` or penalties reads only its immutable params): the number of its
outputs (committed + in flight: `min_tokens`, the noise counter of a seeded draw) and, for a
request with penalties, their values, which needs every earlier step committed: while such a
request has a sample in flight the loop commits before scheduling (no overlap then).

Any backend with `schedule_ahead` / `commit_oldest` / `num_inflight` (the Python `Scheduler`)
can be driven; `LLM` runs the serial loop for the others, or under
`MINISGL_DISABLE_OVERLAP_SCHEDULING=1`.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from minisgl.core import SamplingParams
from minisgl.engine.staging import InputFill
from minisgl.engine.stream import DeviceStream, PendingSample, StepHandle
from minisgl.sampler import SampleResult, TokenLogprob
from minisgl.scheduler.backend import ScheduledReq
from minisgl.scheduler.plan import StepPlan, unknown_inputs
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
    def plan(self) -> StepPlan: ...
    @property
    def reqs(self) -> Sequence[Any]: ...


class CommitLike(Protocol):
    @property
    def outputs(self) -> Sequence[StepOutput]: ...


@runtime_checkable
class PipelinedBackend(Protocol):
    """The pipelined mode of a scheduler backend (see `scheduler.scheduler`)."""

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
class SampleView:
    """What the sampler reads of a request, as of the step's submission."""

    rid: int
    params: SamplingParams
    generator: Any
    input_ids: np.ndarray
    output_ids: Sequence[int]


@dataclass(frozen=True)
class Committed:
    """One committed step, its dropped tokens left out: the outputs, and by request id the
    logprobs asked for and the errors of rows that failed alone."""

    outputs: list[StepOutput]
    logprobs: dict[int, TokenLogprob]
    errors: dict[int, str]


@dataclass
class _Step:
    handle: StepHandle
    rows: list[Any]  # the sample rows: a `SampleView`, or the request (greedy, no history)


class OverlapLoop:
    """Drives a pipelined scheduler and an engine with one step ahead on a `DeviceStream`."""

    def __init__(
        self,
        sched: PipelinedBackend,
        engine: Any,  # Engine | SimEngine: `device`, `sample_on_device`
        eos_ids: frozenset[int],
        stream: DeviceStream,
        max_slots: int,
    ) -> None:
        self.sched = sched
        self.engine = engine
        self.eos = eos_ids
        self.stream = stream
        self.device = engine.device
        self.last_tokens = torch.zeros(max_slots, dtype=torch.int64, device=self.device)
        self._steps: deque[_Step] = deque()
        self._pending: Counter[int] = Counter()  # rid -> samples in flight
        self._penalized: Counter[int] = Counter()  # rid with penalties -> samples in flight

    @property
    def num_inflight(self) -> int:
        return len(self._steps)

    def step(self) -> Committed | None:
        """Schedule and submit the next step, then commit the oldest one in flight if another
        stays in flight (or nothing more could be scheduled). None: nothing committed."""
        if self._penalized and self._steps:  # the sampler needs committed outputs
            return self._commit()
        ahead = self.sched.schedule_ahead()
        if ahead is not None:
            self._submit(ahead.plan, ahead.reqs)
        if len(self._steps) > (1 if ahead is not None else 0):
            return self._commit()
        return None

    def drain(self, fail: bool = False) -> list[Committed]:
        """Commit every step in flight; `fail`: a step whose device work raised commits as
        token 0 (the caller has aborted its requests: every token is dropped)."""
        done = []
        while self._steps:
            done.append(self._commit(fail))
        return done

    def close(self) -> None:
        self.stream.close()

    # ------------------------------------------------------------------ internals
    def _submit(self, plan: StepPlan, reqs: Sequence[ScheduledReq]) -> None:
        rows: list[Any] = [reqs[r] for r in plan.sample_rows.tolist()]
        for k, req in enumerate(rows):
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
        unknown, slots = unknown_inputs(plan)
        sample_slots = plan.slots[plan.sample_rows]
        handle = self.stream.submit(
            lambda: self._device_step(plan, rows, unknown, slots, sample_slots)
        )
        self._steps.append(_Step(handle, rows))

    def _device_step(
        self,
        plan: StepPlan,
        rows: list[Any],
        unknown: np.ndarray,
        slots: np.ndarray,
        sample_slots: np.ndarray,
    ) -> PendingSample:
        """On the device: resolve the in-flight inputs by index, forward, sample, keep the
        tokens for the next step."""
        dev = self.device
        fill = None
        if len(unknown):
            src = torch.from_numpy(slots.astype(np.int64)).to(dev, non_blocking=True)
            dst = torch.from_numpy(unknown).to(dev, non_blocking=True)
            fill = InputFill(dst, self.last_tokens[src])
        sample = self.engine.sample_on_device(plan, rows, self.eos, fill)
        if len(sample_slots):
            at = torch.from_numpy(sample_slots.astype(np.int64)).to(dev, non_blocking=True)
            self.last_tokens[at] = sample.tokens
        return sample

    def _commit(self, fail: bool = False) -> Committed:
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
        commit = self.sched.commit_oldest(res.tokens)
        outs, lps, errs = [], {}, {}
        for k, out in enumerate(commit.outputs):
            if out.finish_reason == DROPPED:
                continue
            outs.append(out)
            if res.logprobs[k] is not None:
                lps[out.rid] = res.logprobs[k]
            if res.errors[k]:
                errs[out.rid] = res.errors[k]
        return Committed(outs, lps, errs)
