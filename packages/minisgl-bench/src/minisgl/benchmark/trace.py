"""Per-request stage gaps from the server's trace files (`MINISGL_TRACE_DIR`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TraceReport:
    stages: list[str] = field(default_factory=list)
    timelines: dict[int, dict[str, float]] = field(default_factory=dict)
    gaps_ms: dict[str, list[float]] = field(default_factory=dict)
    warmup_requests: int = 0

    @property
    def requests(self) -> int:
        return len(self.timelines)

    def to_json(self) -> dict[str, Any]:
        return {"gaps_ms": {}}


def summarize(trace_dir: Path) -> TraceReport:
    return TraceReport()
