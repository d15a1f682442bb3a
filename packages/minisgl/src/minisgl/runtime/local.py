"""The control plane in this process: a scheduler backend stepped by a `StepLoop`, and the
choices of an n > 1 request held until their leader's prefill (then the prefix cache hands
them the prompt's KV instead of recomputing it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from minisgl.core import SamplingParams
from minisgl.runtime.loop import EMPTY, StepBatch, StepLoop
from minisgl.scheduler.backend import SchedulerBackend
from minisgl.scheduler.request import validate_request


@dataclass(frozen=True)
class HeldChoice:
    rid: int
    input_ids: np.ndarray
    params: SamplingParams
    generator: Any


class LocalPlane:
    def __init__(self, sched: SchedulerBackend, loop: StepLoop, max_seq_len: int) -> None:
        self.sched = sched
        self.loop = loop
        self.max_seq_len = max_seq_len
        self.held: dict[int, list[HeldChoice]] = {}  # leader rid -> choices waiting for it

    def add(
        self,
        rid: int,
        input_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        generator: Any,
        leader: int | None,
    ) -> None:
        """Queue a request (RequestError: it can never be served); a choice whose leader is
        still in its prefill waits for it."""
        if leader is not None and self.prefilling(leader):
            kv = self.sched.kv_usage()
            ids, _ = validate_request(
                input_ids, params, self.max_seq_len, kv["total_pages"], self.sched.page_size
            )
            self.held.setdefault(leader, []).append(HeldChoice(rid, ids, params, generator))
            return
        self.sched.add_request(input_ids, params, rid=rid, generator=generator)

    def prefilling(self, rid: int) -> bool:
        req = self.sched.requests.get(rid)
        return req is not None and not req.output_ids

    def abort(self, rid: int) -> None:
        self.sched.abort(rid)
        if self.held:
            self._drop_held(rid)

    def finish(self, rid: int, reason: str) -> None:
        self.sched.finish(rid, reason)

    def has_work(self) -> bool:
        return self.sched.has_work() or self.loop.num_inflight > 0 or bool(self.held)

    def step(self) -> StepBatch:
        batch = self.loop.step()
        if batch is not None and batch.errors:  # such a request fails alone; the others go on
            for rid in batch.errors:
                self.sched.abort(rid)
            keep = [k for k, o in enumerate(batch.outputs) if o.rid not in batch.errors]
            outs = [batch.outputs[k] for k in keep]
            batch = StepBatch(outs, [batch.logprobs[k] for k in keep], batch.errors)
        if self.held:
            self._release_held()
        return batch if batch is not None else EMPTY

    def drain(self, fail: bool = False) -> list[StepBatch]:
        return self.loop.drain(fail)

    def fail_all(self) -> list[int]:
        rids = list(self.sched.requests) + [c.rid for cs in self.held.values() for c in cs]
        self.held.clear()
        for rid in list(self.sched.requests):
            self.sched.abort(rid)
        self.loop.drain(fail=True)
        return rids

    def close(self) -> None:
        self.loop.close()

    def _release_held(self) -> None:
        for leader in [r for r in self.held if not self.prefilling(r)]:
            for c in self.held.pop(leader):
                self.sched.add_request(c.input_ids, c.params, rid=c.rid, generator=c.generator)

    def _drop_held(self, rid: int) -> None:
        for leader, choices in list(self.held.items()):
            self.held[leader] = [c for c in choices if c.rid != rid]
            if not self.held[leader]:
                del self.held[leader]
