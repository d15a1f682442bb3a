"""The prefix cache part of the `Scheduler`: computed prefixes into the radix cache while a
request runs (cache unfinished requests), and a finished request's KV into it on release."""

from __future__ import annotations

import numpy as np

from minisgl.scheduler.request import Req
from minisgl.scheduler.state import SchedulerState


class PrefixCache(SchedulerState):
    def _cache_prefix(self, req: Req, defer: list[np.ndarray] | None = None) -> None:
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
        `present >= cache_len` always holds: `[0, cache_len)` is locked in the cache. With
        `defer` (pipelined mode) the duplicates are appended there instead of freed.
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
            if defer is None:
                self.alloc.free_locations(dup)
            else:
                defer.append(dup)
        self.cache.lock(match.node)
        self.cache.unlock(req.cache_node)
        req.cache_node = match.node
        req.cache_len = aligned

    def _release(self, req: Req) -> None:
        """Free a request's slot and pages, its computed page-aligned KV going to the cache
        (only the cached prefix on abort; the prompt's only without `cache_outputs`).
        Pipelined, `kv_len` may count a position whose token was dropped: the insert is
        clamped to the known tokens."""
        ps, slot = self.page_size, req.slot
        row = self.alloc.page_table[slot]
        all_tokens = req.all_tokens()
        known = min(req.kv_len, len(all_tokens) if self.cache_outputs else len(req.input_ids))
        aligned = known // ps * ps if req.finish_reason != "abort" else req.cache_len
        tokens = all_tokens[:aligned]
        present = self.cache.insert(tokens, row[:aligned].copy())
        # [cache_len, present): duplicates of KV the cache already holds; [aligned, alloc): tail
        self.alloc.free_locations(row[req.cache_len : present])
        self.alloc.free_locations(row[max(aligned, present) : req.alloc_len])
        self.cache.unlock(req.cache_node)
        self.alloc.free_slot(slot)
        req.saved_output_ids = req.output_ids
        req.slot, req.cache_node = -1, None  # its lengths read 0 from now on
