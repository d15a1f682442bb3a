"""The state every part of the `Scheduler` reads and writes: the allocator and page table, the
slot table, the prefix cache, the queues and the counters. Each part is one class on it
(`prefix_cache`, `admission`, `decode`, `inflight`) and `Scheduler` composes them, as the Rust
core's `SchedCore` is one struct whose `impl` blocks live in `sched.rs` and `sched/pipeline.rs`."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from minisgl.kvcache import create_prefix_cache
from minisgl.kvcache.allocator import PageAllocator
from minisgl.scheduler.backend import IN_BATCH_PREFIX_MIN
from minisgl.scheduler.cpu_backend import served_counter
from minisgl.scheduler.request import Req
from minisgl.scheduler.slots import SlotTable
from minisgl.scheduler.stats import KvUsage, SchedulerStats
from minisgl.step.plan import StepPlan


@dataclass(frozen=True)
class Inflight:
    """A step scheduled ahead and not yet committed (pipelined mode)."""

    step: int
    reqs: list[Req]
    slots: np.ndarray  # of `reqs`
    sample_rows: np.ndarray
    reads: np.ndarray  # every KV location the step reads or writes
    deferred_free: list[np.ndarray]  # duplicate location runs to free on commit


class SchedulerState:
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
        priority_aging_steps: int | None = None,
        in_batch_prefix_min: int = IN_BATCH_PREFIX_MIN,
        cache_outputs: bool = True,
    ) -> None:
        if priority_aging_steps is not None and (
            isinstance(priority_aging_steps, bool)
            or not isinstance(priority_aging_steps, int)
            or priority_aging_steps <= 0
        ):
            raise ValueError(
                f"priority_aging_steps must be a positive int or None, got {priority_aging_steps!r}"
            )
        self.priority_aging_steps = priority_aging_steps
        self._clock = 0  # steps scheduled so far (the priority aging clock)
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self.max_running = max_running_requests
        self.max_extend_tokens = max_extend_tokens
        self.in_batch_prefix_min = in_batch_prefix_min
        self.cache_outputs = cache_outputs  # False: a finished request caches its prompt only
        self.eos_token_ids = frozenset(eos_token_ids)
        self._eos = sorted(self.eos_token_ids)
        self.alloc = PageAllocator(num_pages, page_size, max_running_requests, max_seq_len)
        self.table = SlotTable.empty(max_running_requests, max_seq_len)
        self.cache = create_prefix_cache(cache_type, page_size)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted, in admission order (prefilling or decoding)
        self._run_slots: np.ndarray | None = None  # slots of `running` (None: recompute)
        self._last_decode: StepPlan | None = None  # the last step, while it was a decode step
        self.requests: dict[int, Req] = {}
        self.stats = SchedulerStats()
        self._rids = itertools.count()
        self._served = served_counter("python")
        self._inflight: deque[Inflight] = deque()  # pipelined mode
        self._retiring: list[Req] = []  # finished / retired, waiting for unconfirmed steps
        self._next_step = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ running list
    def _running_slots(self) -> np.ndarray:
        """The slots of `running`, in its order (cached until `running` changes)."""
        if self._run_slots is None:
            self._run_slots = np.array(list(map(attrgetter("slot"), self.running)), np.int64)
        return self._run_slots

    def _join_running(self, req: Req) -> None:
        self.running.append(req)
        self._run_slots = None

    def _leave_running(self, req: Req) -> None:
        self.running.remove(req)
        self._run_slots = None

    # ------------------------------------------------------------------ KV growth
    def _ensure_capacity(self, slots: np.ndarray, lengths: np.ndarray) -> None:
        """Give each request of `slots` KV locations up to `lengths`, in order (evicting from
        the prefix cache only when the free pages run out)."""
        ps, t = self.page_size, self.table
        alloc = t.alloc_len[slots]  # page aligned
        grow = alloc < lengths
        if not grow.all():
            if not grow.any():
                return
            slots, alloc, lengths = slots[grow], alloc[grow], lengths[grow]
        need = (lengths - alloc + ps - 1) // ps
        if int(need.sum()) > self.alloc.num_free_pages:  # one at a time, evicting as it goes
            for slot, n in zip(slots.tolist(), need.tolist(), strict=True):
                short = n - self.alloc.num_free_pages
                if short > 0:
                    self.alloc.free_locations(self.cache.evict(short * ps))
                self.alloc.alloc_pages(slot, int(t.alloc_len[slot]), n)
                t.alloc_len[slot] += n * ps
            return
        self.alloc.alloc_pages_batch(slots, alloc, need)
        t.alloc_len[slots] = alloc + need * ps

    def kv_usage(self) -> KvUsage:
        return {
            "total_pages": self.alloc.num_pages,
            "free_pages": self.alloc.num_free_pages,
            "cached_tokens": self.cache.evictable_size + self.cache.protected_size,
            "running": len(self.running),
            "waiting": len(self.waiting),
        }
