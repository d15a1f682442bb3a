"""The collectives a tensor-parallel forward runs, on the default process group: one all-reduce
after each row-parallel GEMM (o_proj, down_proj) and after the vocab-parallel embedding, one
gather of the vocab-parallel logits."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from minisgl.distributed.layout import TPInfo


class Comm:
    def __init__(self, info: TPInfo, vocab_size: int) -> None:
        self.info = info
        self.vocab_size = vocab_size
        self.calls = 0  # collectives run, and the host seconds spent in them (benchmarks)
        self.seconds = 0.0

    def reset_stats(self) -> None:
        self.calls, self.seconds = 0, 0.0

    def _timed(self, op: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        op()
        self.seconds += time.perf_counter() - t0
        self.calls += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        self._timed(lambda: dist.all_reduce(x))
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, vocab] from every rank's [n, rows] slice (padding rows cut off)."""
        parts = [torch.empty_like(logits) for _ in range(self.info.size)]
        self._timed(lambda: dist.all_gather(parts, logits.contiguous()))
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place."""
        self._timed(lambda: dist.broadcast(x, src=0))
        return x
