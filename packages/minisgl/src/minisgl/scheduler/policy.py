"""Scheduling policies by name (vLLM's `--scheduling-policy`): `fcfs`, first come first served,
or `priority`, the waiting queue ordered by each request's `priority` (lower first, FIFO
within a priority) with aging: a waiting request gains a level every `AGING_STEPS` steps."""

from __future__ import annotations

POLICIES = ("fcfs", "priority")
AGING_STEPS = 16  # as the workload replay's default (`minisgl-cpu-service replay`)


def priority_aging_steps(policy: str) -> int | None:
    """The scheduler's `priority_aging_steps` for `policy` (None: FIFO); ValueError if unknown."""
    if policy not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return AGING_STEPS if policy == "priority" else None
