"""One thread budget for a process: torch's pools and the tokenizer's."""

from __future__ import annotations

import contextlib
import os


def set_threads(n: int) -> None:
    """`n` threads: torch intra-op and inter-op pools, and the tokenizer (its Rust thread pool
    would otherwise add a thread per core beside torch's and oversubscribe the cores)."""
    import torch

    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)
    with contextlib.suppress(RuntimeError):  # only settable before the first parallel region
        torch.set_num_interop_threads(n)
