"""What an engine's warm-up ran (`Runtime.warm_up`): reported by the python engine worker's
`Ready` and the rust_service GPU worker's `WorkerHello` (the service forwards it in its
`Ready`) under the `warmup` key of `info`, shown by the API server in /health and /metrics."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

INFO_KEY = "warmup"


@dataclass(frozen=True)
class WarmUpReport:
    """One warm-up: `kind` "graphs" (a compiled engine's graphs, every compile length and
    batch) or "shapes" (a few prefill lengths and decode batches); `prefix_extend`: a prefill
    on a cached prefix ran too; `steps`: scheduler steps; `leaked_pages`: KV pages neither free
    nor in the prefix cache afterwards (0: the warm-up scheduler passed its integrity check)."""

    kind: str
    prefill_lengths: tuple[int, ...]
    prefix_extend: bool
    decode_batches: tuple[int, ...]
    requests: int
    steps: int
    leaked_pages: int
    seconds: float

    def info(self) -> dict[str, Any]:
        """The wire form (msgpack / JSON: lists for tuples)."""
        out = dataclasses.asdict(self)
        out["prefill_lengths"] = list(self.prefill_lengths)
        out["decode_batches"] = list(self.decode_batches)
        return out

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> WarmUpReport | None:
        """The report in a worker's `info` (`info()` under `INFO_KEY`); None when it has none
        (a worker of an older build) or it does not parse."""
        raw = info.get(INFO_KEY)
        if not isinstance(raw, dict):
            return None
        try:
            return cls(
                kind=str(raw["kind"]),
                prefill_lengths=tuple(int(n) for n in raw["prefill_lengths"]),
                prefix_extend=bool(raw["prefix_extend"]),
                decode_batches=tuple(int(n) for n in raw["decode_batches"]),
                requests=int(raw["requests"]),
                steps=int(raw["steps"]),
                leaked_pages=int(raw["leaked_pages"]),
                seconds=float(raw["seconds"]),
            )
        except (KeyError, TypeError, ValueError):
            return None

    def summary(self) -> str:
        """One log line."""
        extend = ", a prefix extend" if self.prefix_extend else ""
        return (
            f"warm-up ({self.kind}): prefill lengths {list(self.prefill_lengths)}{extend}, "
            f"decode batches {list(self.decode_batches)}: {self.requests} requests, "
            f"{self.steps} steps in {self.seconds:.2f} s, {self.leaked_pages} pages leaked"
        )
