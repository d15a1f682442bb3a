"""The collectives a tensor-parallel forward runs, on the default process group: one all-reduce
after each row-parallel GEMM (o_proj, down_proj) and after the vocab-parallel embedding, one
gather of the vocab-parallel logits."""

from __future__ import annotations

import torch
import torch.distributed as dist

from minisgl.distributed.layout import TPInfo


class Comm:
    def __init__(self, info: TPInfo, vocab_size: int) -> None:
        self.info = info
        self.vocab_size = vocab_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        dist.all_reduce(x)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, vocab] from every rank's [n, rows] slice (padding rows cut off)."""
        parts = [torch.empty_like(logits) for _ in range(self.info.size)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place."""
        dist.broadcast(x, src=0)
        return x
