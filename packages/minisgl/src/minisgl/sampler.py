"""Batched sampling: greedy rows by argmax, the rest by temperature / top-k / top-p."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minisgl.core import SamplingParams


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """logits: float32 [n, vocab]; one SamplingParams and generator per row."""
    out = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if not p.is_greedy:
            out[i] = _sample_row(logits[i], p, generators[i])
    return out.tolist()


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = cum - sorted_probs > p.top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen).item())
