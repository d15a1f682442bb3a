"""The device side of one step, written once for every loop: each input still in flight (`-1`,
a pipelined decode input, local or sent by the Rust service) is the last token sampled in its
row's page-table slot; forward and sample; keep this step's tokens by slot for the next one.
The last tokens stay on the device: no host round trip between two steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from minisgl.engine.stream import PendingSample
from minisgl.sampler import SampleResult
from minisgl.step.plan import StepPlan, unknown_inputs
from minisgl.step.staging import InputFill


class DeviceStep:
    def __init__(self, engine: Any, eos_ids: frozenset[int], num_slots: int) -> None:
        self.engine = engine  # Engine | SimEngine: `device`, `sample_on_device`
        self.eos = eos_ids
        self.device = engine.device
        self.last_tokens = torch.zeros(max(num_slots, 1), dtype=torch.int64, device=self.device)

    def job(self, plan: StepPlan, rows: Sequence[Any]) -> Callable[[], PendingSample]:
        """The step as a job for a `DeviceStream` (what it reads of the plan is taken now)."""
        unknown, slots = unknown_inputs(plan)
        sample_slots = plan.slots[plan.sample_rows]
        top = int(max(slots.max(initial=-1), sample_slots.max(initial=-1)))
        if top >= len(self.last_tokens):  # a service may hand out more slots than expected
            grown = torch.zeros(top + 1, dtype=torch.int64, device=self.device)
            grown[: len(self.last_tokens)] = self.last_tokens
            self.last_tokens = grown
        return lambda: self._run(plan, rows, unknown, slots, sample_slots)

    def run(self, plan: StepPlan, rows: Sequence[Any]) -> SampleResult:
        """The step now, on this thread."""
        sample = self.job(plan, rows)()
        sample.start_copy()
        return sample.result()

    def _run(
        self,
        plan: StepPlan,
        rows: Sequence[Any],
        unknown: np.ndarray,
        slots: np.ndarray,
        sample_slots: np.ndarray,
    ) -> PendingSample:
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
