"""Steps the Rust service schedules, run here: the worker half of the `rust_service` backend.

Each `Step` is a flat plan (`step.plan.PLAN_SEGMENTS`) plus the requests first seen in it
and the ones the service forgot. What sampling needs of a request (its params, key, prompt and
the tokens sampled so far) lives here, by request id; a plan input of -1 is resolved on the
device (`DeviceStep`). Steps run strictly in the order they arrive; a failed forward is
reported (`fatal`: every row's request fails), never raised. No scheduling logic here.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import traceback
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from minisgl.core import SamplingParams
from minisgl.engine.stream import DeviceStream, StepHandle
from minisgl.message.schema import AddReq, Step, StepResult, wire_logprob
from minisgl.runtime.device_step import DeviceStep
from minisgl.sampler import SampleResult, TokenLogprob, request_key
from minisgl.step.plan import FlatStep, PlanLayout, StepPlan


@dataclass(eq=False)
class WorkerReq:
    """A request's sampling state (the sampler's `SampleRow`), and what it sampled."""

    rid: int
    input_ids: np.ndarray
    params: SamplingParams
    generator: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)


class ServiceSteps:
    """`keep_released`: a request the service forgot stays readable in `released` until its
    reader pops it (the offline API reads its tokens after the service's last word on it)."""

    def __init__(self, device: DeviceStep, keep_released: bool = False) -> None:
        self.device = device
        self.reqs: dict[int, WorkerReq] = {}
        self.keep_released = keep_released
        self.released: dict[int, WorkerReq] = {}

    def get(self, rid: int) -> WorkerReq | None:
        req = self.reqs.get(rid)
        return req if req is not None else self.released.get(rid)

    def run(self, step: Step) -> StepResult:
        """The step now, on this thread."""
        try:
            prepared = self.prepare(step)
            return self.complete(prepared, self.device.run(prepared.plan, prepared.rows))
        except Exception as e:
            return failed(step, e)

    def prepare(self, step: Step) -> Prepared:
        """Take the step's request changes and build its plan and sample rows."""
        for rid in step.release.tolist():
            req = self.reqs.pop(rid, None)
            if req is not None and self.keep_released:
                self.released[rid] = req
        for packed in step.new:
            r = AddReq.unpack(packed)
            params = r.params.to_sampling_params()
            ids = np.asarray(r.input_ids, np.int32)
            self.reqs[r.uid] = WorkerReq(r.uid, ids, params, request_key(params.seed))
        data = np.array(step.plan, dtype=np.int32)
        plan = FlatStep(bool(step.is_prefill), PlanLayout(*step.sizes), data).plan()
        rows = [self.reqs[int(step.rids[r])] for r in plan.sample_rows.tolist()]
        return Prepared(step.step, plan, rows)

    def complete(self, prepared: Prepared, res: SampleResult) -> StepResult:
        """Append the sampled tokens to their requests; the result for the service."""
        for req, tok, lp in zip(prepared.rows, res.tokens, res.logprobs, strict=True):
            req.output_ids.append(tok)
            if req.params.logprobs is not None:
                req.logprobs.append(lp)
        tokens = np.asarray(res.tokens, dtype=np.int32)
        errors = res.errors if any(res.errors) else []
        lps = [wire_logprob(lp) for lp in res.logprobs] if any(res.logprobs) else []
        return StepResult(prepared.step, tokens, errors, lps)


@dataclass(frozen=True)
class Prepared:
    """A step ready for the device: its plan and its sample rows."""

    step: int
    plan: StepPlan
    rows: list[WorkerReq]

    @property
    def goes_ahead(self) -> bool:
        """Its sampler reads only immutable params (greedy, no min_tokens, no history): it may
        run before the steps ahead of it are read back."""
        return all(
            r.params.is_greedy and not r.params.min_tokens and not r.params.needs_history
            for r in self.rows
        )


def failed(step: Step, e: Exception) -> StepResult:
    traceback.print_exc()
    return StepResult(step.step, np.zeros(0, np.int32), fatal=f"engine error: {e!r}")


@dataclass(eq=False)
class _InFlight:
    prepared: Prepared
    handle: StepHandle
    done: threading.Event = field(default_factory=threading.Event)
    res: SampleResult | None = None
    error: Exception | None = None


class ServicePipeline:
    """A Rust service's steps on a `DeviceStream`: each step is submitted as it arrives, so
    the device runs step k+1 right after step k while the worker sends k's result (the service
    keeps `--depth` steps in flight). A step that does not `goes_ahead` first waits for every
    step before it (its sampler reads their tokens). A waiter thread reads the steps back in
    order and writes a byte to a pipe for each: `fileno()` is readable when `ready()` has a
    result, so a worker polls it with its inbox."""

    def __init__(self, steps: ServiceSteps, stream: DeviceStream, depth: int = 2) -> None:
        self.steps = steps
        self.stream = stream
        self.depth = depth
        self._inflight: deque[_InFlight] = deque()
        self._queue: queue.SimpleQueue[_InFlight | None] = queue.SimpleQueue()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self._waiter = threading.Thread(target=self._wait, name="minisgl-step-waiter", daemon=True)
        self._waiter.start()

    @property
    def pending(self) -> int:
        return len(self._inflight)

    def fileno(self) -> int:
        return self._r

    def submit(self, step: Step) -> list[StepResult]:
        """Send `step` to the device; returns the results of the steps it had to wait for."""
        try:
            prepared = self.steps.prepare(step)
        except Exception as e:
            return [*self.wait_all(), failed(step, e)]
        out = [] if prepared.goes_ahead else self.wait_all()
        handle = self.stream.submit(self.steps.device.job(prepared.plan, prepared.rows))
        item = _InFlight(prepared, handle)
        self._inflight.append(item)
        self._queue.put(item)
        return out

    def ready(self) -> list[StepResult]:
        """The results of the steps read back so far, in order (never blocks)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._r, 4096)
        out = []
        while self._inflight and self._inflight[0].done.is_set():
            out.append(self._finish(self._inflight.popleft()))
        return out

    def wait_oldest(self) -> StepResult:
        item = self._inflight.popleft()
        item.done.wait()
        return self._finish(item)

    def wait_all(self) -> list[StepResult]:
        return [self.wait_oldest() for _ in range(len(self._inflight))]

    def close(self) -> None:
        self._queue.put(None)
        self._waiter.join(timeout=5)
        self.stream.close()
        os.close(self._r)
        os.close(self._w)

    def _finish(self, item: _InFlight) -> StepResult:
        p = item.prepared
        if item.error is not None:  # a failed forward: every row's request fails
            return StepResult(p.step, np.zeros(0, np.int32), fatal=f"engine error: {item.error!r}")
        assert item.res is not None
        return self.steps.complete(p, item.res)

    def _wait(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                item.res = item.handle.result()
            except Exception as e:  # the step failed on the device: its rows fail
                traceback.print_exc()
                item.error = e
            item.done.set()
            with contextlib.suppress(OSError):
                os.write(self._w, b"\0")
