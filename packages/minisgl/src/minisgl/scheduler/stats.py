from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict


class KvUsage(TypedDict):
    """`SchedulerBackend.kv_usage()`: KV pool and queue occupancy (read by tests and /metrics)."""

    total_pages: int
    free_pages: int
    cached_tokens: int
    running: int
    waiting: int


@dataclass
class SchedulerStats:
    """Counters and per-step CPU timers of the scheduler (read by benchmarks and /metrics)."""

    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    schedule_s: list[float] = field(default_factory=list)
    commit_s: list[float] = field(default_factory=list)

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
