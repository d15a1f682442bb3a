"""Shadow mode: the other CPU backend runs beside the primary on every decision.

`ShadowScheduler` is itself a `SchedulerBackend` that composes two backends through that
protocol only (`factory.make_scheduler` builds it under `MINISGL_CPU_BACKEND_SHADOW=1`).

Every `add_request`, `schedule`, `commit` and `finish` is replayed on the shadow with the
same inputs (the primary's sampled tokens); differences are written as JSON lines to
`MINISGL_CPU_BACKEND_SHADOW_REPORT` (at most `MINISGL_CPU_BACKEND_SHADOW_MAX_DIFFS`). The
primary's answer is always what serves, except when a Rust primary raises while the shadow is
the Python reference: then the reference serves that call and every later one (fallback).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from minisgl.core import SamplingParams
from minisgl.scheduler import cpu_backend
from minisgl.scheduler.backend import ScheduledReq, ScheduledStep, SchedulerBackend
from minisgl.scheduler.request import StepOutput
from minisgl.scheduler.stats import KvUsage, SchedulerStats
from minisgl.step.plan import PLAN_FIELDS, StepPlan


def _short(x: Any, n: int = 16) -> Any:
    if isinstance(x, np.ndarray):
        x = x.tolist()
    if isinstance(x, list) and len(x) > n:
        return [*x[:n], f"... ({len(x)} items)"]
    return x


class ShadowScheduler:
    """Serves with `primary`, replays every call on `shadow` and reports differences."""

    def __init__(self, primary: SchedulerBackend, shadow: SchedulerBackend) -> None:
        self.primary = primary
        self.shadow = shadow
        self.report_path = os.environ.get(cpu_backend.ENV_SHADOW_REPORT) or None
        self.max_diffs = int(os.environ.get(cpu_backend.ENV_SHADOW_MAX, "1000"))
        self.step = 0
        self.diffs = 0
        # (the shadow's step or None, the primary's step) of the last schedule
        self._pending: tuple[ScheduledStep | None, ScheduledStep | None] | None = None
        self._shadow_ok = True
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the primary's state
    @property
    def backend(self) -> str:
        return f"{self.primary.backend}+shadow:{self.shadow.backend}"

    @property
    def page_size(self) -> int:
        return self.primary.page_size

    @property
    def stats(self) -> SchedulerStats:
        return self.primary.stats

    @property
    def requests(self) -> Mapping[int, ScheduledReq]:
        return self.primary.requests

    @property
    def running(self) -> Sequence[ScheduledReq]:
        return self.primary.running

    @property
    def waiting(self) -> Sequence[ScheduledReq]:
        return self.primary.waiting

    # ------------------------------------------------------------------ reporting
    def _diff(self, kind: str, **detail: Any) -> None:
        self.diffs += 1
        cpu_backend.count_shadow("diffs")
        cpu_backend.count_shadow(f"diffs.{kind}")
        if self.report_path is None or self.diffs > self.max_diffs:
            return
        rec = {
            "ts": time.time(),
            "kind": kind,
            "step": self.step,
            "primary_backend": self.primary.backend,
            "shadow_backend": self.shadow.backend,
            **{k: _short(v) for k, v in detail.items()},
        }
        with self._lock, open(self.report_path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        cpu_backend.count_shadow("written")

    def _shadow_call(
        self, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> tuple[bool, Any]:
        if not self._shadow_ok:
            return False, None
        try:
            return True, fn(*args, **kwargs)
        except Exception as e:
            self._diff(kind, error=f"shadow raised {type(e).__name__}: {e}")
            return False, e

    def _fallback(self, kind: str, exc: BaseException) -> bool:
        """Promote a Python shadow after a Rust primary raised; True when it happened."""
        if self.shadow.backend != "python" or not self._shadow_ok:
            return False
        cpu_backend.record_fallback(f"runtime.{kind}", exc)
        self._diff(kind, error=f"primary raised {type(exc).__name__}: {exc}", fallback=True)
        self.primary, self._shadow_ok = self.shadow, False
        return True

    # ------------------------------------------------------------------ decisions
    def add_request(
        self,
        input_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        rid: int | None = None,
        generator: Any = None,
    ) -> int:
        cpu_backend.count_shadow("decisions")
        try:
            rid = self.primary.add_request(input_ids, params, rid=rid, generator=generator)
        except Exception as e:
            ok, _ = self._shadow_call(
                "add_request",
                self.shadow.add_request,
                input_ids,
                params,
                rid=rid,
                generator=generator,
            )
            if ok:
                self._diff("add_request", error=f"only the primary raised {e!r}")
            raise
        self._shadow_call(
            "add_request", self.shadow.add_request, input_ids, params, rid=rid, generator=generator
        )
        return rid

    def finish(self, rid: int, reason: str) -> bool:
        cpu_backend.count_shadow("decisions")
        p = self.primary.finish(rid, reason)
        ok, s = self._shadow_call("finish", self.shadow.finish, rid, reason)
        if ok and s != p:
            self._diff("finish", rid=rid, primary=p, shadow=s)
        return p

    def abort(self, rid: int) -> bool:
        return self.finish(rid, "abort")

    def has_work(self) -> bool:
        return self.primary.has_work()

    def schedule(self) -> ScheduledStep | None:
        cpu_backend.count_shadow("decisions")
        self.step += 1
        try:
            p = self.primary.schedule()
        except Exception as e:
            if not self._fallback("schedule", e):
                raise
            return self.primary.schedule()
        ok, s = self._shadow_call("schedule", self.shadow.schedule)
        self._pending = (s if ok else None, p)
        if not ok:
            return p
        if (p is None) != (s is None):
            self._diff("schedule", field="idle", primary=p is None, shadow=s is None)
            return p
        if p is None:
            return p
        (pp, preqs), (sp, sreqs) = p, s
        if pp.is_prefill != sp.is_prefill:
            self._diff("schedule", field="is_prefill", primary=pp.is_prefill, shadow=sp.is_prefill)
        for name in PLAN_FIELDS:
            a, b = getattr(pp, name), getattr(sp, name)
            if a.shape != b.shape or not np.array_equal(a, b):
                self._diff("schedule", field=name, primary=a, shadow=b)
        prids, srids = [r.rid for r in preqs], [r.rid for r in sreqs]
        if prids != srids:
            self._diff("schedule", field="rids", primary=prids, shadow=srids)
        return p

    def commit(
        self, reqs: Sequence[Any], plan: StepPlan, next_tokens: Sequence[int]
    ) -> Sequence[StepOutput]:
        cpu_backend.count_shadow("decisions")
        tokens = list(next_tokens)
        pending, self._pending = self._pending, None
        try:
            out = self.primary.commit(reqs, plan, tokens)
        except Exception as e:
            if pending is None or pending[0] is None or not self._fallback("commit", e):
                raise
            sp, sreqs = pending[0]
            return self.primary.commit(sreqs, sp, tokens)
        if pending is not None and pending[0] is not None and self._shadow_ok:
            sp, sreqs = pending[0]
            ok, s = self._shadow_call("commit", self.shadow.commit, sreqs, sp, tokens)
            if ok:
                a = [(o.rid, o.token_id, o.finish_reason) for o in out]
                b = [(o.rid, o.token_id, o.finish_reason) for o in s]
                if a != b:
                    self._diff("commit", primary=a, shadow=b)
                pu, su = self.primary.kv_usage(), self.shadow.kv_usage()
                if pu != su:
                    self._diff("kv_usage", primary=pu, shadow=su)
        return out

    def check_integrity(self) -> None:
        self.primary.check_integrity()
        if self._shadow_ok:
            self._shadow_call("integrity", self.shadow.check_integrity)

    def kv_usage(self) -> KvUsage:
        return self.primary.kv_usage()
