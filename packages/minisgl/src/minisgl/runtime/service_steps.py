"""Steps the Rust service schedules, run here: the worker half of the `rust_service` backend.

Each `Step` is a flat plan (`step.plan.PLAN_SEGMENTS`) plus the requests first seen in it
and the ones the service forgot. What sampling needs of a request (its params, key, prompt and
the tokens sampled so far) lives here, by request id; a plan input of -1 is resolved on the
device (`DeviceStep`). Steps run strictly in the order they arrive; a failed forward is
reported (`fatal`: every row's request fails), never raised. No scheduling logic here.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import numpy as np

from minisgl.core import SamplingParams
from minisgl.message.schema import Step, StepReq, StepResult, wire_logprob
from minisgl.runtime.device_step import DeviceStep
from minisgl.sampler import TokenLogprob, request_key
from minisgl.step.plan import FlatStep, PlanLayout


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
        try:
            return self._run(step)
        except Exception as e:
            traceback.print_exc()
            return StepResult(step.step, np.zeros(0, np.int32), fatal=f"engine error: {e!r}")

    def _run(self, step: Step) -> StepResult:
        for rid in step.release.tolist():
            req = self.reqs.pop(rid, None)
            if req is not None and self.keep_released:
                self.released[rid] = req
        for packed in step.new:
            r = StepReq.unpack(packed)
            params = r.params.to_sampling_params()
            ids = np.asarray(r.input_ids, np.int32)
            self.reqs[r.rid] = WorkerReq(r.rid, ids, params, request_key(params.seed))
        data = np.array(step.plan, dtype=np.int32)
        plan = FlatStep(bool(step.is_prefill), PlanLayout(*step.sizes), data).plan()
        rows = [self.reqs[int(step.rids[r])] for r in plan.sample_rows.tolist()]
        res = self.device.run(plan, rows)
        for req, tok, lp in zip(rows, res.tokens, res.logprobs, strict=True):
            req.output_ids.append(tok)
            if req.params.logprobs is not None:
                req.logprobs.append(lp)
        tokens = np.asarray(res.tokens, dtype=np.int32)
        errors = res.errors if any(res.errors) else []
        lps = [wire_logprob(lp) for lp in res.logprobs] if any(res.logprobs) else []
        return StepResult(step.step, tokens, errors, lps)


class ServicePipeline:
    """Steps of a Rust service on a device stream (not yet: serial)."""

    def __init__(self, steps: ServiceSteps, stream: object, depth: int = 2) -> None:
        import os

        self.steps = steps
        self.stream = stream
        self.depth = depth
        self._done: list[StepResult] = []
        self._r, self._w = os.pipe()

    @property
    def pending(self) -> int:
        return len(self._done)

    def fileno(self) -> int:
        return self._r

    def submit(self, step: Step) -> list[StepResult]:
        self._done.append(self.steps.run(step))
        return []

    def ready(self) -> list[StepResult]:
        return []

    def wait_oldest(self) -> StepResult:
        return self._done.pop(0)

    def close(self) -> None:
        import os

        os.close(self._r)
        os.close(self._w)
