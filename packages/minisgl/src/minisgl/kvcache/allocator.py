"""Page allocation and the per-slot page table (host side, plain numpy).

The page table maps (request slot, token position) -> KV location. It is the state the
scheduler's per-step plan reads from, and the one a Rust implementation shares zero-copy.
"""

from __future__ import annotations

import numpy as np


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, max_slots: int, max_seq_len: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        # lowest page ids are handed out first (deterministic, mirrors the Rust port)
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self._free_slots: list[int] = list(range(max_slots - 1, -1, -1))
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        width = -(-max_seq_len // page_size) * page_size
        self.page_table = np.zeros((max_slots, width), dtype=np.int32)
        self._offsets = np.arange(page_size, dtype=np.int32)

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def alloc_slot(self) -> int:
        if not self._free_slots:
            raise OutOfPages("no free request slot")
        return self._free_slots.pop()

    def free_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    def alloc_pages(self, slot: int, start: int, num_pages: int) -> None:
        """Give `slot` `num_pages` new pages covering token positions [start, start + n*ps)."""
        if num_pages > len(self._free_pages):
            raise OutOfPages(f"need {num_pages} pages, {len(self._free_pages)} free")
        if num_pages == 0:
            return
        pages = np.array(self._free_pages[-num_pages:][::-1], dtype=np.int32)
        del self._free_pages[-num_pages:]
        locs = (pages[:, None] * self.page_size + self._offsets[None, :]).reshape(-1)
        self.page_table[slot, start : start + len(locs)] = locs

    def alloc_pages_batch(self, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> None:
        """`alloc_pages(slots[i], starts[i], counts[i])` for every i in order, in one go."""
        n = int(counts.sum())
        if n > len(self._free_pages):
            raise OutOfPages(f"need {n} pages, {len(self._free_pages)} free")
        if n == 0:
            return
        pages = np.array(self._free_pages[-n:][::-1], dtype=np.int64)
        del self._free_pages[-n:]
        ps = self.page_size
        locs = (pages[:, None] * ps + self._offsets[None, :]).reshape(-1)
        if ps == 1 and (counts == 1).all():  # one location each (a decode step)
            self.page_table[slots, starts] = locs
            return
        per = counts * ps  # locations of each request
        first = np.cumsum(per) - per  # its first one in `locs`
        rows = np.repeat(slots, per)
        cols = np.repeat(starts - first, per) + np.arange(n * ps)
        self.page_table[rows, cols] = locs

    def free_locations(self, locs: np.ndarray) -> None:
        """Return the pages that own these page-aligned token locations."""
        if len(locs) == 0:
            return
        pages = locs[:: self.page_size] // self.page_size
        self._free_pages.extend(pages[::-1].tolist())

    def owned_pages(self, locs: np.ndarray) -> np.ndarray:
        return locs[:: self.page_size] // self.page_size
