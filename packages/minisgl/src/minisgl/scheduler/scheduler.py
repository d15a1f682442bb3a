"""Continuous batching with chunked prefill and a prefix cache.

Each step is either a prefill step (admit / continue prompts under `max_extend_tokens`) or a
decode step (one token for every running request). Admission reserves, for every admitted
request, the pages it can still need (prompt + max_tokens), so decode never runs out of KV.

Unfinished requests are cached as soon as they are prefilled ("cache unfinished request"):
`commit` of a prefill step inserts every batch request's page-aligned computed prefix into the
radix cache (see `Scheduler._cache_prefix` for the exact order of operations, which the Rust
core mirrors), so a request admitted while an earlier one with the same prefix is still
running reuses its KV. A request always owns exactly `[cache_len, alloc_len)` of its row.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from minisgl.core import SamplingParams
from minisgl.kvcache import RadixCache, create_prefix_cache
from minisgl.kvcache.allocator import PageAllocator
from minisgl.scheduler.cpu_backend import served_counter
from minisgl.scheduler.plan import StepPlan, build_step_plan
from minisgl.scheduler.request import Req, StepOutput
from minisgl.scheduler.stats import SchedulerStats


class RequestError(ValueError):
    """The request can never be served as asked (empty prompt, longer than the context...)."""


class ContextLengthError(RequestError):
    """The prompt (plus its generated tokens) does not fit the context or the KV pool."""


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def validate_request(
    input_ids: Sequence[int] | np.ndarray,
    params: SamplingParams,
    max_seq_len: int,
    num_pages: int,
    page_size: int,
) -> tuple[np.ndarray, int]:
    """The prompt as int32 and its total length cap, or a RequestError saying why it can never
    be served (shared by every scheduler backend)."""
    ids = np.asarray(input_ids, dtype=np.int32).reshape(-1)
    if len(ids) == 0:
        raise RequestError("prompt is empty: at least one token is required")
    if len(ids) >= max_seq_len:
        raise ContextLengthError(
            f"prompt has {len(ids)} tokens, the context holds {max_seq_len} "
            "(prompt plus at least one generated token)"
        )
    max_total = min(len(ids) + params.max_tokens, max_seq_len)
    if _pages(max_total, page_size) > num_pages:
        raise ContextLengthError(
            f"request needs {max_total} tokens of KV, the pool holds {num_pages * page_size}"
        )
    return ids, max_total


class Scheduler:
    """The Python reference scheduler.

    `Scheduler(...)` returns the backend chosen by `cpu_backend=` or `MINISGL_CPU_BACKEND`
    (see `minisgl.scheduler.cpu_backend`): this class for `python`, a `RustScheduler` for
    `rust_hotpath`, wrapped in a `ShadowScheduler` under `MINISGL_CPU_BACKEND_SHADOW=1`.
    """

    backend = "python"

    def __new__(cls, *args, cpu_backend: str | None = None, **kwargs):
        if cls is Scheduler:
            from minisgl.scheduler.cpu_backend import create_scheduler

            alt = create_scheduler(cpu_backend, kwargs)
            if alt is not None:
                return alt
        return super().__new__(cls)

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
        cpu_backend: str | None = None,
    ) -> None:
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self.max_running = max_running_requests
        self.max_extend_tokens = max_extend_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.alloc = PageAllocator(num_pages, page_size, max_running_requests, max_seq_len)
        self.cache = create_prefix_cache(cache_type, page_size)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted, in admission order (prefilling or decoding)
        self.requests: dict[int, Req] = {}
        self.stats = SchedulerStats()
        self._rids = itertools.count()
        self._served = served_counter("python")

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        input_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        rid: int | None = None,
        generator=None,
    ) -> int:
        ids, max_total = validate_request(
            input_ids, params, self.max_seq_len, self.alloc.num_pages, self.page_size
        )
        rid = next(self._rids) if rid is None else rid
        if rid in self.requests:
            raise RequestError(f"duplicate request id {rid}")
        req = Req(rid, ids, params, max_total, generator=generator)
        req.fill_ids = ids
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def abort(self, rid: int) -> bool:
        """Finish a request now (client gone, stop string hit...); frees all it holds."""
        return self.finish(rid, "abort")

    def finish(self, rid: int, reason: str) -> bool:
        req = self.requests.get(rid)
        if req is None:
            return False
        req.finish_reason = reason
        if req.slot >= 0:
            self.running.remove(req)
            self._release(req)
        else:
            self.waiting.remove(req)
        del self.requests[rid]
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> tuple[StepPlan, list[Req]] | None:
        t0 = time.perf_counter()
        self._served["schedule"] += 1
        batch = self._schedule_prefill()
        plan = self._prefill_plan(batch) if batch else self._decode_plan()
        self.stats.schedule_s.append(time.perf_counter() - t0)
        return plan

    def commit(
        self, reqs: list[Req], plan: StepPlan, next_tokens: Sequence[int]
    ) -> list[StepOutput]:
        """Advance KV lengths, cache prefilled prefixes, append sampled tokens, finish and
        release requests.

        Order: (1) `kv_len += extend_len` for every batch request; (2) on a prefill step with
        the radix cache, `_cache_prefix` for every batch request in batch order; (3) per sample
        row in order: append the token, apply the finish rules, release a finished request.
        """
        t0 = time.perf_counter()
        self._served["commit"] += 1
        for req, n in zip(reqs, plan.extend_lens.tolist(), strict=True):
            req.kv_len += n
        if plan.is_prefill and isinstance(self.cache, RadixCache):
            for req in reqs:
                self._cache_prefix(req)
        outputs: list[StepOutput] = []
        for row, token in zip(plan.sample_rows.tolist(), next_tokens, strict=True):
            req = reqs[row]
            req.output_ids.append(token)
            reason = self._finish_reason(req, token)
            if reason is not None:
                req.finish_reason = reason
                self.running.remove(req)
                self._release(req)
                del self.requests[req.rid]
            outputs.append(StepOutput(req.rid, token, reason))
        self.stats.commit_s.append(time.perf_counter() - t0)
        self.stats.steps += 1
        self.stats.generated_tokens += len(outputs)
        return outputs

    def _finish_reason(self, req: Req, token: int) -> str | None:
        p = req.params
        if p.stop_token_ids and token in p.stop_token_ids:
            return "stop"
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if (
            len(req.output_ids) >= p.max_tokens
            or len(req.input_ids) + len(req.output_ids) >= req.max_total_len
        ):
            return "length"
        return None

    # ------------------------------------------------------------------ admission
    def _reserved_pages(self) -> int:
        """Pages admitted requests may still allocate (up to their max_total_len)."""
        ps = self.page_size
        return sum(_pages(r.max_total_len, ps) - r.alloc_len // ps for r in self.running)

    def _schedule_prefill(self) -> list[tuple[Req, int]]:
        budget = self.max_extend_tokens
        batch: list[tuple[Req, int]] = []
        for req in [r for r in self.running if r.in_prefill]:  # chunked prompts continue first
            if budget <= 0:
                break
            n = min(req.prefill_len - req.kv_len, budget)
            batch.append((req, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            if not self._admit(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            n = min(req.prefill_len - req.kv_len, budget)
            batch.append((req, n))
            budget -= n
        for req, n in batch:
            self._ensure_capacity(req, req.kv_len + n)
        return batch

    def _admit(self, req: Req) -> bool:
        ps = self.page_size
        fill = req.fill_ids
        assert fill is not None
        match = self.cache.match_prefix(fill[: len(fill) - 1])
        self.cache.lock(match.node)
        need = _pages(req.max_total_len, ps) - match.length // ps
        avail = self.alloc.num_free_pages + self.cache.evictable_size // ps - self._reserved_pages()
        if need > avail or self.alloc.num_free_slots == 0:
            self.cache.unlock(match.node)
            return False
        req.slot = self.alloc.alloc_slot()
        m = match.length
        self.alloc.page_table[req.slot, :m] = match.indices
        req.kv_len = req.alloc_len = req.cache_len = m
        req.cache_node = match.node
        if not req.output_ids:
            req.cached_tokens = m
            self.stats.prompt_tokens += len(fill)
            self.stats.cached_prompt_tokens += m
        return True

    def _ensure_capacity(self, req: Req, length: int) -> None:
        ps = self.page_size
        need = _pages(length, ps) - req.alloc_len // ps
        if need <= 0:
            return
        short = need - self.alloc.num_free_pages
        if short > 0:
            self.alloc.free_locations(self.cache.evict(short * ps))
        self.alloc.alloc_pages(req.slot, req.alloc_len, need)
        req.alloc_len += need * ps

    # ------------------------------------------------------------------ plans
    def _prefill_plan(self, batch: list[tuple[Req, int]]) -> tuple[StepPlan, list[Req]]:
        reqs = [r for r, _ in batch]
        starts = np.array([r.kv_len for r in reqs], dtype=np.int32)
        lens = np.array([n for _, n in batch], dtype=np.int32)
        ids = np.concatenate([r.fill_ids[r.kv_len : r.kv_len + n] for r, n in batch])
        sample = starts + lens == np.array([r.prefill_len for r in reqs])
        slots = np.array([r.slot for r in reqs], dtype=np.int32)
        plan = build_step_plan(self.alloc.page_table, slots, starts, lens, ids, sample, True)
        return plan, reqs

    def _decode_plan(self) -> tuple[StepPlan, list[Req]] | None:
        reqs = self.running
        if not reqs:
            return None
        for req in reqs:
            self._ensure_capacity(req, req.kv_len + 1)
        n = len(reqs)
        slots = np.fromiter((r.slot for r in reqs), dtype=np.int32, count=n)
        starts = np.fromiter((r.kv_len for r in reqs), dtype=np.int32, count=n)
        ids = np.fromiter((r.output_ids[-1] for r in reqs), dtype=np.int32, count=n)
        ones = np.ones(n, dtype=np.int32)
        plan = build_step_plan(
            self.alloc.page_table, slots, starts, ones, ids, np.ones(n, dtype=bool), False
        )
        return plan, list(reqs)

    # ------------------------------------------------------------------ caching
    def _cache_prefix(self, req: Req) -> None:
        """Hand the computed page-aligned prefix of a running request to the radix cache.

        With `aligned = kv_len // page_size * page_size`, nothing happens unless
        `aligned > cache_len`. Otherwise, in this exact order (it fixes the logical clock, the
        node ids and the allocator's free stack, which the Rust core reproduces):
        1. `present = cache.insert(fill_ids[:aligned], row[:aligned])` (one clock tick; the
           cache takes `row[present:aligned]`);
        2. `match = cache.match_prefix(fill_ids[:aligned])` (one clock tick; ends at `aligned`,
           never splits since the insert already ended a node there);
        3. if `present > cache_len`: `row[cache_len:present]` were duplicates of KV another
           request inserted meanwhile: remember them, write `match.indices[cache_len:present]`
           into the row, then `free_locations(duplicates)`;
        4. `cache.lock(match.node)`, then `cache.unlock(old cache_node)` (lock first, so the
           shared path never drops to ref 0);
        5. `cache_node = match.node`, `cache_len = aligned`.
        `present >= cache_len` always holds: `[0, cache_len)` is locked in the cache.
        """
        ps = self.page_size
        aligned = req.kv_len // ps * ps
        if aligned <= req.cache_len:
            return
        fill = req.fill_ids
        assert fill is not None
        row = self.alloc.page_table[req.slot]
        tokens = fill[:aligned]
        present = self.cache.insert(tokens, row[:aligned].copy())
        match = self.cache.match_prefix(tokens)
        assert match.length == aligned and present >= req.cache_len
        if present > req.cache_len:
            dup = row[req.cache_len : present].copy()
            row[req.cache_len : present] = match.indices[req.cache_len : present]
            self.alloc.free_locations(dup)
        self.cache.lock(match.node)
        self.cache.unlock(req.cache_node)
        req.cache_node = match.node
        req.cache_len = aligned

    # ------------------------------------------------------------------ release
    def _release(self, req: Req) -> None:
        ps, slot = self.page_size, req.slot
        row = self.alloc.page_table[slot]
        aligned = req.kv_len // ps * ps if req.finish_reason != "abort" else req.cache_len
        tokens = req.all_tokens()[:aligned]
        present = self.cache.insert(tokens, row[:aligned].copy())
        # [cache_len, present): duplicates of KV the cache already holds; [aligned, alloc): tail
        self.alloc.free_locations(row[req.cache_len : present])
        self.alloc.free_locations(row[max(aligned, present) : req.alloc_len])
        self.cache.unlock(req.cache_node)
        self.alloc.free_slot(slot)
        req.slot, req.cache_node = -1, None
        req.kv_len = req.alloc_len = req.cache_len = 0

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Every page is exactly one of: free, owned by the cache, owned by a live request."""
        ps = self.page_size
        owners = np.zeros(self.alloc.num_pages, dtype=np.int32)
        free = np.array(self.alloc._free_pages, dtype=np.int64)
        np.add.at(owners, free, 1)
        np.add.at(owners, self.cache.all_indices()[::ps] // ps, 1)
        for req in self.running:
            own = self.alloc.page_table[req.slot, req.cache_len : req.alloc_len]
            np.add.at(owners, own[::ps] // ps, 1)
        bad = np.flatnonzero(owners != 1)
        if len(bad):
            raise AssertionError(
                f"KV integrity: {len(bad)} pages with owner count != 1, e.g. page {int(bad[0])} "
                f"owned {int(owners[bad[0]])} times"
            )
        self.cache.check_integrity()
        if len(self.running) + self.alloc.num_free_slots != self.alloc.max_slots:
            raise AssertionError("KV integrity: request slots leaked")

    def kv_usage(self) -> dict[str, int]:
        return {
            "total_pages": self.alloc.num_pages,
            "free_pages": self.alloc.num_free_pages,
            "cached_tokens": self.cache.evictable_size + self.cache.protected_size,
            "running": len(self.running),
            "waiting": len(self.waiting),
        }
