"""The in-process `rust_hotpath` scheduler, for tests and benchmarks only (P1-012).

The runtime switch is `python | rust_service`; nothing the runtime imports loads the
`minisgl_cpu` PyO3 extension, and this is the one module that does. `register()` adds
`rust_hotpath` to the scheduler registry of the calling process, so equivalence tests, shadow
mode and the offline A/B benchmark can still run the Rust core in process.

One Python->Rust call per scheduler step (`SchedulerCore.schedule_step`, returning one flat
int32 numpy array that the plan's fields are views of) and one per commit
(`SchedulerCore.commit_step`): the step-level interface of `backend.SchedulerBackend`. The flat
buffer's layout is `plan.PLAN_SEGMENTS`; the extension's own layout (`minisgl_cpu.plan_segments`)
is checked against it when a scheduler is built. Python keeps only the request objects the
sampler needs (params, generator) and mirrors the running / waiting order; per-request state
(KV lengths, outputs) is read from Rust on demand, never copied per step.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from minisgl.core import SamplingParams
from minisgl.kvcache.allocator import OutOfPages
from minisgl.kvcache.base import MatchResult
from minisgl.scheduler import cpu_backend
from minisgl.scheduler.backend import IN_BATCH_PREFIX_MIN, ScheduledStep
from minisgl.scheduler.request import FINISH_REASONS, RequestError, StepOutput, validate_request
from minisgl.scheduler.stats import KvUsage, SchedulerStats
from minisgl.step.plan import PlanLayout, StepPlan, split_flat

NAME = "rust_hotpath"


def extension() -> Any:
    import minisgl_cpu

    return minisgl_cpu


def available() -> bool:
    """Whether the extension imports here (built with `maturin develop`)."""
    try:
        extension()
    except ImportError:
        return False
    return True


def register() -> None:
    """Make `MINISGL_CPU_BACKEND=rust_hotpath` (and `make_scheduler(cfg, "rust_hotpath")`)
    build a `RustScheduler` in this process; idempotent. Raises ImportError without the
    extension."""
    from minisgl.scheduler import factory

    extension()
    if NAME not in factory.available_backends():
        factory.register_backend(NAME, _scheduler)


def _scheduler(config: Any) -> RustScheduler:
    """A `RustScheduler` from a `SchedulerConfig`."""
    return RustScheduler(**dataclasses.asdict(config))


def check_plan_layout(ext: Any) -> None:
    """Raise RuntimeError unless the extension lays a flat plan out as `PLAN_SEGMENTS` (an
    extension built from other sources than this package)."""
    fn = getattr(ext, "plan_segments", None)
    probe = PlanLayout(bs=3, num_tokens=5, num_kv=7, num_sample=2)
    got = None if fn is None else tuple(tuple(s) for s in fn(3, 5, 7, 2))
    if got != probe.segments():
        raise RuntimeError(
            f"minisgl_cpu {getattr(ext, '__version__', '?')} lays step plans out as {got}, "
            f"this package expects {probe.segments()}: rebuild the extension"
        )


# ---------------------------------------------------------------------- radix cache adapter
class RustRadixCache:
    """`PrefixCache` over `minisgl_cpu.RadixCache` (one crossing per call)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._c = extension().RadixCache(page_size)

    def match_prefix(self, tokens: np.ndarray) -> MatchResult:
        h, idx = self._c.match_prefix(np.ascontiguousarray(tokens, dtype=np.int32))
        return MatchResult(h, idx)

    def lock(self, node: Any) -> None:
        if node is not None:
            self._c.lock(node)

    def unlock(self, node: Any) -> None:
        if node is not None:
            self._c.unlock(node)

    def insert(self, tokens: np.ndarray, indices: np.ndarray) -> int:
        return self._c.insert(
            np.ascontiguousarray(tokens, dtype=np.int32),
            np.ascontiguousarray(indices, dtype=np.int32),
        )

    def evict(self, num_tokens: int) -> np.ndarray:
        return self._c.evict(int(num_tokens))

    def node_id(self, node: Any) -> int:
        return self._c.node_id(node)

    def insert_batch(
        self, tokens: np.ndarray, offsets: np.ndarray, indices: np.ndarray
    ) -> np.ndarray:
        return self._c.insert_batch(tokens, offsets, indices)

    def match_batch(self, tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        return self._c.match_batch(tokens, offsets)

    @property
    def evictable_size(self) -> int:
        return self._c.evictable_size

    @property
    def protected_size(self) -> int:
        return self._c.protected_size

    def all_indices(self) -> np.ndarray:
        return self._c.all_indices()

    def check_integrity(self) -> None:
        self._c.check_integrity()


# ---------------------------------------------------------------------- scheduler
class RustReq:
    """A request of the Rust scheduler: params / generator in Python, state read from Rust."""

    __slots__ = (
        "_cached",
        "_core",
        "_final",
        "finish_reason",
        "generator",
        "input_ids",
        "max_total_len",
        "params",
        "rid",
    )

    def __init__(
        self,
        core,
        rid: int,
        ids: np.ndarray,
        params: SamplingParams,
        max_total_len: int,
        generator: Any,
    ) -> None:
        self._core = core
        self.rid = rid
        self.input_ids = ids
        self.params = params
        self.max_total_len = max_total_len
        self.generator = generator
        self.finish_reason: str | None = None
        self._final: list[int] | None = None  # generated tokens, once Rust forgot the request
        self._cached = 0  # prefix-cache hit of the admission

    def _info(self) -> tuple[int, int, int, int, int, int]:
        info = self._core.request_info(self.rid)
        return info if info is not None else (0, 0, 0, -1, 0, 0)

    @property
    def output_ids(self) -> list[int]:
        if self._final is not None:
            return self._final
        out = self._core.output_ids(self.rid)
        return [] if out is None else out.tolist()

    @property
    def kv_len(self) -> int:
        return self._info()[0]

    @property
    def alloc_len(self) -> int:
        return self._info()[1]

    @property
    def cache_len(self) -> int:
        return self._info()[2]

    @property
    def slot(self) -> int:
        return self._info()[3]

    @property
    def cached_tokens(self) -> int:
        return self._cached

    @property
    def fill_ids(self) -> np.ndarray:
        return self.input_ids

    @property
    def prefill_len(self) -> int:
        return len(self.input_ids)

    @property
    def in_prefill(self) -> bool:
        return self.kv_len < self.prefill_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def all_tokens(self) -> np.ndarray:
        out = np.asarray(self.output_ids, dtype=np.int32)
        return np.concatenate([self.input_ids, out]) if len(out) else self.input_ids

    def _forget(self) -> None:
        self._final = self.output_ids

    def __repr__(self) -> str:
        return f"RustReq(rid={self.rid}, finish_reason={self.finish_reason!r})"


class StepOutputs(Sequence):
    """The outputs of one commit, built lazily (no per-token Python objects on the hot path)."""

    __slots__ = ("_codes", "_reqs", "_tokens")

    def __init__(self, reqs: list[RustReq], tokens: list[int], codes: bytes) -> None:
        self._reqs, self._tokens, self._codes = reqs, tokens, codes

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return list(self)[i]
        return StepOutput(self._reqs[i].rid, self._tokens[i], FINISH_REASONS[self._codes[i]])

    def __iter__(self) -> Iterator[StepOutput]:
        for req, tok, code in zip(self._reqs, self._tokens, self._codes):
            yield StepOutput(req.rid, tok, FINISH_REASONS[code])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


class _CacheView:
    def __init__(self, core, page_size: int) -> None:
        self._core, self.page_size = core, page_size

    @property
    def evictable_size(self) -> int:
        return self._core.evictable_size

    @property
    def protected_size(self) -> int:
        return self._core.protected_size


class _AllocView:
    def __init__(self, core, num_pages: int, page_size: int, max_slots: int) -> None:
        self._core, self.num_pages, self.page_size, self.max_slots = (
            core,
            num_pages,
            page_size,
            max_slots,
        )

    @property
    def num_free_pages(self) -> int:
        return self._core.num_free_pages

    @property
    def num_free_slots(self) -> int:
        return self._core.num_free_slots

    @property
    def page_table(self) -> np.ndarray:
        return self._core.page_table()  # a copy: the live table is in Rust


class RustScheduler:
    """Drop-in for `Scheduler` with the CPU state in Rust (see the module docstring)."""

    backend = "rust_hotpath"

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_seq_len: int,
        max_running_requests: int,
        max_extend_tokens: int,
        cache_type: str,
        eos_token_ids: Sequence[int] = (),
        in_batch_prefix_min: int = IN_BATCH_PREFIX_MIN,
        priority_aging_steps: int | None = None,
        cache_outputs: bool = True,
    ) -> None:
        # the PyO3 binding has no priority scheduling (the service's `--priority-aging-steps` has)
        if priority_aging_steps is not None:
            raise ValueError(f"{NAME} has no priority scheduling (priority_aging_steps)")
        if not cache_outputs:  # the service's `--no-cache-outputs` has it
            raise ValueError(f"{NAME} always caches outputs (cache_outputs)")
        if cache_type not in ("radix", "naive"):
            raise ValueError(f"unknown cache_type {cache_type!r} (expected 'radix' or 'naive')")
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self.max_running = max_running_requests
        self.max_extend_tokens = max_extend_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_pages = num_pages
        ext = extension()
        check_plan_layout(ext)  # once per scheduler: microseconds
        self.core = ext.SchedulerCore(
            num_pages=num_pages,
            page_size=page_size,
            max_seq_len=max_seq_len,
            max_running_requests=max_running_requests,
            max_extend_tokens=max_extend_tokens,
            radix=cache_type == "radix",
            eos_token_ids=sorted(int(t) for t in eos_token_ids),
            in_batch_prefix_min=in_batch_prefix_min,
        )
        self.alloc = _AllocView(self.core, num_pages, page_size, max_running_requests)
        self.cache = _CacheView(self.core, page_size)
        self.waiting: deque[RustReq] = deque()
        self.running: list[RustReq] = []
        self.requests: dict[int, RustReq] = {}
        self.stats = SchedulerStats()
        self._rids = itertools.count()
        self._last: ScheduledStep | None = None
        self._served = cpu_backend.served_counter("rust_hotpath")

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        input_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        rid: int | None = None,
        generator: Any = None,
    ) -> int:
        ids, max_total = validate_request(
            input_ids, params, self.max_seq_len, self.num_pages, self.page_size
        )
        rid = next(self._rids) if rid is None else rid
        if rid in self.requests:
            raise RequestError(f"duplicate request id {rid}")
        ids = np.ascontiguousarray(ids)
        self.core.add_request(
            rid,
            ids,
            max_total,
            params.max_tokens,
            params.ignore_eos,
            list(params.stop_token_ids or ()),
        )
        req = RustReq(self.core, rid, ids, params, max_total, generator)
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def abort(self, rid: int) -> bool:
        return self.finish(rid, "abort")

    def finish(self, rid: int, reason: str) -> bool:
        req = self.requests.get(rid)
        if req is None:
            return False
        req.finish_reason = reason
        req._forget()
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self.core.finish(rid, abort=reason == "abort")
        del self.requests[rid]
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ScheduledStep | None:
        t0 = time.perf_counter()
        self._served["schedule"] += 1
        try:
            res = self.core.schedule_step()
        except RuntimeError as e:
            msg = str(e)
            if msg.startswith("OutOfPages: "):
                raise OutOfPages(msg[len("OutOfPages: ") :]) from None
            raise
        if res is None:
            self._last = None
            self.stats.schedule_s.append(time.perf_counter() - t0)
            return None
        is_prefill, admitted, bs, t, nkv, ns, flat = res
        running = self.running
        for _ in range(admitted):
            req = self.waiting.popleft()
            req._cached = self.core.request_info(req.rid)[4]
            running.append(req)
        *fields, batch_pos = split_flat((bs, t, nkv, ns), flat)
        if is_prefill:
            reqs = [running[i] for i in batch_pos.tolist()]
            p, c = self.core.counters()
            self.stats.prompt_tokens, self.stats.cached_prompt_tokens = p, c
        else:
            reqs = list(running)
        self._last = ScheduledStep(StepPlan(is_prefill, *fields), reqs)
        self.stats.schedule_s.append(time.perf_counter() - t0)
        return self._last

    def commit(
        self, reqs: Sequence[RustReq], plan: StepPlan, next_tokens: Sequence[int]
    ) -> StepOutputs:
        t0 = time.perf_counter()
        self._served["commit"] += 1
        if self._last is None or self._last.plan is not plan:
            raise RuntimeError("commit of a plan that is not the last scheduled step")
        self._last = None
        tokens = next_tokens if isinstance(next_tokens, list) else list(next_tokens)
        codes, finished = self.core.commit_step(tokens)
        sample_reqs = reqs if not plan.is_prefill else [reqs[r] for r in plan.sample_rows.tolist()]
        for k, outs in finished:
            req = sample_reqs[k]
            req.finish_reason = FINISH_REASONS[codes[k]]
            req._final = outs
            self.running.remove(req)
            del self.requests[req.rid]
        outputs = StepOutputs(sample_reqs, tokens, codes)
        self.stats.commit_s.append(time.perf_counter() - t0)
        self.stats.steps += 1
        self.stats.generated_tokens += len(tokens)
        return outputs

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        self.core.check_integrity()
        if len(self.running) != self.core.num_running or len(self.waiting) != self.core.num_waiting:
            raise AssertionError("rust scheduler: Python mirror of running/waiting diverged")

    def kv_usage(self) -> KvUsage:
        return {
            "total_pages": self.num_pages,
            "free_pages": self.core.num_free_pages,
            "cached_tokens": self.core.evictable_size + self.core.protected_size,
            "running": len(self.running),
            "waiting": len(self.waiting),
        }
