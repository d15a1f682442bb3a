"""Freeze a server process's start-up heap (`gc.freeze`), as vLLM's engine and API server do.

After start-up (torch, transformers, FastAPI, the model and tokenizer loaded, warm-up done) a
process holds hundreds of thousands of objects that live as long as it does. Every full
(generation 2) collection rescanned all of them: 100-185 ms pauses in the API server and the
workers mid-benchmark on the 2-core machine. Frozen, they sit in a permanent generation the
collector skips; cycles made while serving are still collected.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect the start-up garbage once, then freeze what is left. Returns how many objects
    are frozen (also `gc.get_freeze_count()`)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
