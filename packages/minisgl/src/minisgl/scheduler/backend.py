"""The seam between the scheduler and its callers: `SchedulerBackend`, and its configuration.

`LLM` (and through it the server's engine worker) only ever talks to a `SchedulerBackend`
built by `minisgl.scheduler.factory.make_scheduler`; which class serves is chosen there by
name (`MINISGL_CPU_BACKEND`), from a registry a new backend joins with `register_backend`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from minisgl.core import SamplingParams
from minisgl.scheduler.request import StepOutput
from minisgl.scheduler.stats import KvUsage, SchedulerStats
from minisgl.step.plan import StepPlan

CACHE_TYPES = ("radix", "naive")
# a waiting request sharing this many uncached prompt tokens with a request of the prefill step
# being built waits for the next step, where they are cached (SGLang's in-batch prefix check)
IN_BATCH_PREFIX_MIN = 32


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything a backend needs to be built (the same for every backend)."""

    num_pages: int
    page_size: int
    max_seq_len: int
    max_running_requests: int
    max_extend_tokens: int
    cache_type: str = "radix"
    eos_token_ids: tuple[int, ...] = ()
    in_batch_prefix_min: int = IN_BATCH_PREFIX_MIN  # 0: no check
    priority_aging_steps: int | None = None  # priority scheduling (params.priority); None: FIFO
    # a finished request's generated tokens join the prefix cache (False: its prompt only, the
    # deterministic mode's rule: a decode step's K / V are not the prefill path's to the bit)
    cache_outputs: bool = True

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_seq_len", "max_running_requests",
                     "max_extend_tokens"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"scheduler config: {name} must be a positive int, got {v!r}")
        v = self.in_batch_prefix_min
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(
                f"scheduler config: in_batch_prefix_min must be an int >= 0, got {v!r}"
            )
        if self.cache_type not in CACHE_TYPES:
            raise ValueError(
                f"unknown cache_type {self.cache_type!r} (expected 'radix' or 'naive')"
            )
        object.__setattr__(self, "eos_token_ids", tuple(sorted({int(t) for t in
                                                                self.eos_token_ids})))  # fmt: skip


@runtime_checkable
class ScheduledReq(Protocol):
    """What a caller reads of a request a backend scheduled (sampling inputs, results)."""

    @property
    def rid(self) -> int: ...
    @property
    def params(self) -> SamplingParams: ...
    @property
    def generator(self) -> Any: ...  # torch.Generator | None, owned by the sampler
    @property
    def input_ids(self) -> np.ndarray: ...
    @property
    def output_ids(self) -> list[int]: ...
    @property
    def finish_reason(self) -> str | None: ...


@dataclass(frozen=True)
class SampleView:
    """A scheduled request as the sampler reads it at one moment: a step in flight (outputs
    still on the device), or a speculative verify row (outputs extended by the drafts before
    it). Never finished."""

    rid: int
    params: SamplingParams
    generator: Any
    input_ids: np.ndarray
    output_ids: Sequence[int]
    finish_reason: str | None = None
    drafts: int = 0  # a verify row: how many of the last `output_ids` are drafts


class ScheduledStep(NamedTuple):
    """One scheduled step: the plan the engine runs and the batch's requests, in batch order
    (`plan.sample_rows` index into `reqs`)."""

    plan: StepPlan
    reqs: Sequence[ScheduledReq]


@runtime_checkable
class SchedulerBackend(Protocol):
    """A scheduler CPU backend: request queue, admission, prefix cache, page allocator, step
    plans and finish rules. Callers drive it one step at a time:

        step = backend.schedule()                 # None when there is nothing to run
        logits = engine.forward(step.plan)        # flat int32 arrays, see `plan.PLAN_SEGMENTS`
        tokens = sample(logits, [step.reqs[r].params for r in step.plan.sample_rows])
        outputs = backend.commit(step.reqs, step.plan, tokens)  # one StepOutput per token

    Contract (every backend, checked by the equivalence and parity suites):
    - `add_request` validates with `request.validate_request` and raises `RequestError`
      (a `ValueError`) for a request that can never be served, or a duplicate id; nothing is
      queued then.
    - `schedule` / `commit` alternate strictly; `commit` gets the `reqs` and `plan` of the
      last `schedule` and exactly `len(plan.sample_rows)` tokens. Given the same calls, every
      backend returns the same plans, the same `StepOutput`s and the same `kv_usage()` as the
      Python reference (`scheduler.Scheduler`).
    - `finish(rid, reason)` / `abort(rid)` end a request at once and free what it holds
      (False for an unknown id); a finished request leaves `requests`.
    - `check_integrity` raises AssertionError when a KV page or request slot is leaked.

    The step-level interface an out-of-process backend implements (`rust_service`, to be
    registered with `factory.register_backend` without touching `LLM` or the engine):
    - schedule: one request/response per step; the service answers a `plan.FlatStep`
      (`is_prefill`, the `PlanLayout` sizes, one int32 buffer laid out as `PLAN_SEGMENTS`,
      the same buffer `minisgl_cpu.SchedulerCore.schedule_step` returns in-process) plus the
      ids of the requests it admitted; `FlatStep.plan()` gives the `StepPlan` as views of the
      buffer, and `batch_pos` maps batch rows to the running list.
    - commit: the sampled token ids (int32, one per sample row) go back; the answer is one
      finish code per sample row (`request.FINISH_REASONS`: 0 running, 1 stop, 2 length) and
      the final outputs of the requests that finished. `StepOutput`s are built from these.
    - add_request / finish / abort are messages carrying the validated prompt, the sampling
      params the finish rules need (max_tokens, ignore_eos, stop_token_ids) and the rid; the
      sampler's state (`generator`) never leaves the caller's process.
    The in-process `rust_hotpath` backend (`rust_backend.RustScheduler`) already speaks
    exactly this over PyO3: one crossing per schedule, one per commit.
    """

    @property
    def backend(self) -> str: ...  # registry name; a wrapper says e.g. "rust_hotpath+shadow:python"
    @property
    def page_size(self) -> int: ...
    @property
    def stats(self) -> SchedulerStats: ...
    @property
    def requests(self) -> Mapping[int, ScheduledReq]: ...  # live (unfinished) requests by id
    @property
    def running(self) -> Sequence[ScheduledReq]: ...  # admitted, in admission order
    @property
    def waiting(self) -> Sequence[ScheduledReq]: ...  # queued, in arrival order

    def add_request(
        self,
        input_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        rid: int | None = None,
        generator: Any = None,
    ) -> int: ...
    def abort(self, rid: int) -> bool: ...
    def finish(self, rid: int, reason: str) -> bool: ...
    def has_work(self) -> bool: ...
    def schedule(self) -> ScheduledStep | None: ...
    def commit(
        self, reqs: Sequence[Any], plan: StepPlan, next_tokens: Sequence[int]
    ) -> Sequence[StepOutput]: ...
    def check_integrity(self) -> None: ...
    def kv_usage(self) -> KvUsage: ...
