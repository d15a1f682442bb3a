"""Step plans without a scheduler: requests laid out in a page table by a real allocator, for
tests that drive an `Engine` (or a graph runner) step by step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from minisgl.core import SamplingParams
from minisgl.kvcache.allocator import PageAllocator
from minisgl.step.plan import StepPlan, build_step_plan


class GreedyRow:
    """A sample row (`SampleRow`) of a plain greedy request."""

    params = SamplingParams(temperature=0.0)
    generator = 0
    input_ids = np.zeros(1, np.int32)
    output_ids: tuple[int, ...] = ()


class PlannedBatch:
    """Requests with random prompts of `lens`, each given pages for `per_request` tokens:
    `plan(True)` prefills them, `plan(False)` is their next decode step, `push` appends."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        vocab: int,
        lens: Sequence[int],
        per_request: int,
        seed: int = 0,
    ) -> None:
        self.alloc = PageAllocator(num_pages, page_size, len(lens), per_request)
        rng = np.random.default_rng(seed)
        self.ids = [list(rng.integers(0, vocab, n)) for n in lens]
        self.slots = []
        for _ in self.ids:
            slot = self.alloc.alloc_slot()
            self.alloc.alloc_pages(slot, 0, -(-per_request // page_size))
            self.slots.append(slot)

    @classmethod
    def for_engine(cls, engine, lens: Sequence[int], per_request: int, seed: int = 0):
        cfg = engine.config
        vocab = engine.model_config.vocab_size
        return cls(engine.num_pages, cfg.page_size, vocab, lens, per_request, seed)

    def plan(self, is_prefill: bool, rows: Sequence[int] | None = None) -> StepPlan:
        rows = range(len(self.ids)) if rows is None else rows
        ids = [self.ids[r] for r in rows]
        if is_prefill:
            starts, ext, feed = [0] * len(ids), [len(t) for t in ids], [x for t in ids for x in t]
        else:
            starts, ext, feed = [len(t) - 1 for t in ids], [1] * len(ids), [t[-1] for t in ids]
        return build_step_plan(self.alloc.page_table, np.array([self.slots[r] for r in rows]),
                               np.array(starts), np.array(ext), np.array(feed),
                               np.ones(len(ids), bool), is_prefill)  # fmt: skip

    def push(self, tokens: Sequence[int]) -> None:
        for t, new in zip(self.ids, tokens, strict=True):
            t.append(int(new))


def batch_decode_logits(llm: Any, prompts: list[list[int]], prefix: int) -> torch.Tensor:
    """fp32 logits [steps, len(prompts), vocab] of an offline `LLM`'s engine: one prefill of
    every prompt's first `prefix` tokens, then decode steps of all of them at once, each row fed
    its prompt's next token (teacher forced; a fresh engine: pool rows 0 .. len(prompts) *
    len(prompt) - 1 are free; the prompts of one length)."""
    b, n = len(prompts), len(prompts[0])
    table = np.arange(b * n, dtype=np.int32).reshape(b, n)
    slots, every = np.arange(b), np.ones(b, dtype=bool)

    def step(start: int, width: int, prefill: bool) -> torch.Tensor:
        ids = [t for p in prompts for t in p[start : start + width]]
        plan = build_step_plan(table, slots, [start] * b, [width] * b, ids, every, prefill)
        return llm.engine.forward(plan).float()

    steps = [step(0, prefix, True)] + [step(t, 1, False) for t in range(prefix, n - 1)]
    return torch.stack(steps)
