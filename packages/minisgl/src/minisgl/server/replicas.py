"""Data-parallel replicas (`--dp N`) as the API server sees them: where a request goes, which
replicas are in rotation, and the per-replica counts of /health and /metrics.

Python backend: the API server routes. A request's uids are `k * N + replica` (one replica for
all its n choices, so they share the prompt's KV), the replica taken round-robin over those in
rotation; the tokenizer workers send each uid to engine worker `uid % N` (`replica_of`).
rust_service: the service routes (longest cached prefix, then load) and reports the split in
its stats (`replicas`); the API server only shows it.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from minisgl import ipc
from minisgl.ipc import replica_of

SUMMED = (
    "running", "waiting", "total_pages", "free_pages", "cached_tokens", "used_pages",
    "cached_pages", "steps", "generated_tokens", "prompt_tokens", "cached_prompt_tokens",
)  # fmt: skip
# speculative decoding's counters (engine_worker.SPEC_COUNTERS), summed when the engines have them
SPEC_SUMMED = ("spec_verify_rows", "spec_drafted_tokens", "spec_accepted_tokens")
GAUGES = ("running", "waiting", "used_pages", "cached_tokens", "cached_pages")  # 0 once down


def worker_names(cpu_backend: str, dp: int) -> list[str]:
    """The process of each replica: its engine worker, or its GPU worker (rust_service)."""
    if cpu_backend == "rust_service":
        return [ipc.worker_name(i) for i in range(dp)]
    return [ipc.scheduler_name(i) for i in range(dp)]


def replica_threads(threads: int | None, dp: int, tp: int, cores: int | None = None) -> int | None:
    """`--threads` of each engine process: as given, else (dp > 1) an equal share of the cores."""
    if threads is not None or dp == 1:
        return threads
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // (dp * tp))


def placed(llm_kwargs: dict, replica: int, dp: int) -> dict:
    """Replica `replica`'s engine arguments, in its worker: on CUDA its block of --tp devices
    from cuda:{replica * tp} (`distributed.placement`; ValueError before any weight loads when
    dp x tp exceeds the visible GPUs). dp=1 keeps the device as given."""
    if dp == 1:
        return llm_kwargs
    import torch

    from minisgl.distributed.placement import replica_device

    device = replica_device(str(llm_kwargs.get("device", "auto")), replica=replica, dp=dp,
                            tp=int(llm_kwargs.get("tp_size", 1)),
                            cuda_count=torch.cuda.device_count())  # fmt: skip
    return {**llm_kwargs, "device": device}


@dataclass(frozen=True)
class Metric:
    name: str
    help: str
    key: str
    kind: str = "gauge"


METRICS = (
    Metric("minisgl_replica_healthy", "1 while the replica is in rotation.", "alive"),
    Metric("minisgl_replica_requests_routed_total", "Requests routed to the replica.", "routed",
           "counter"),
    Metric("minisgl_replica_num_running_requests", "Requests running on the replica.",
           "running"),
    Metric("minisgl_replica_num_queued_requests", "Requests queued on the replica.", "waiting"),
    Metric("minisgl_replica_kv_pages_used", "KV pages not free on the replica.", "used_pages"),
    Metric("minisgl_replica_prompt_tokens_total", "Prompt tokens admitted by the replica.",
           "prompt_tokens", "counter"),
    Metric("minisgl_replica_cached_prompt_tokens_total",
           "Prompt tokens hit in the replica's prefix cache.", "cached_prompt_tokens", "counter"),
    Metric("minisgl_replica_prefix_cache_hit_rate",
           "Prompt tokens served from the replica's prefix cache.", "prefix_hit_rate"),
)  # fmt: skip


class Replicas:
    """`routes`: the API server routes (python backend); else the service does."""

    def __init__(self, dp: int, routes: bool, workers: list[str]) -> None:
        self.dp = dp
        self.routes = routes
        self.workers = workers
        self.pids: list[int | None] = [None] * dp
        self.down: dict[int, str] = {}
        self.routed = [0] * dp
        self.stats: list[dict[str, Any]] = [{} for _ in range(dp)]
        self._next = 0
        self._block = 0
        self._lock = threading.Lock()  # the event loop routes, the supervisor marks deaths

    # ------------------------------------------------------------------ routing
    def new_uids(self, n: int) -> list[int]:
        """Fresh uids for a request's n choices (python backend: all on one replica)."""
        with self._lock:
            if not self.routes:
                first = self._block + 1
                self._block += n
                return list(range(first, first + n))
            replica = self._pick()
            self.routed[replica] += n
            base = self._block + 1
            self._block += n
            return [(base + j) * self.dp + replica for j in range(n)]

    def _pick(self) -> int:
        for k in range(self.dp):
            r = (self._next + k) % self.dp
            if r not in self.down:
                self._next = (r + 1) % self.dp
                return r
        return 0  # every replica is down: the server is unhealthy and admits nothing

    def replica_of(self, uid: int) -> int:
        return replica_of(uid, self.dp)

    # ------------------------------------------------------------------ health
    def mark_down(self, replica: int, reason: str) -> None:
        with self._lock:
            self.down.setdefault(replica, reason)

    def alive(self, replica: int) -> bool:
        return replica not in self.down and bool(self.stats[replica].get("alive", True))

    def any_alive(self) -> bool:
        return any(self.alive(i) for i in range(self.dp))

    # ------------------------------------------------------------------ stats
    def on_stats(self, data: dict[str, Any]) -> dict[str, Any]:
        """Record a scheduler `Stats` payload; returns the whole server's view of it."""
        reps = data.get("replicas")
        if isinstance(reps, list):  # rust_service: the service's split, summed already
            for entry in reps:
                i = int(entry.get("replica", 0))
                if 0 <= i < self.dp:
                    self.stats[i] = entry
            return data
        i = int(data.get("replica", 0))
        if 0 <= i < self.dp:
            self.stats[i] = data
        return data if self.dp == 1 else self.total()

    def total(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: 0 for k in SUMMED}
        for i, st in enumerate(self.stats):
            for k in SUMMED:
                if not (k in GAUGES and i in self.down):
                    out[k] += st.get(k, 0)
        prompt = out["prompt_tokens"]
        out["prefix_hit_rate"] = out["cached_prompt_tokens"] / prompt if prompt else 0.0
        out["integrity_ok"] = min((st.get("integrity_ok", 1) for st in self.stats), default=1)
        out["integrity_pending"] = max(
            (
                st.get("integrity_pending", 0)
                for i, st in enumerate(self.stats)
                if i not in self.down
            ),
            default=0,
        )
        for k in SPEC_SUMMED:
            if k in self.stats[0]:
                out[k] = sum(st.get(k, 0) for st in self.stats)
        out["page_size"] = self.stats[0].get("page_size", 1)
        if "cpu_backend" in self.stats[0]:
            out["cpu_backend"] = self.stats[0]["cpu_backend"]
        return out

    def view(self) -> list[dict[str, Any]]:
        """One entry per replica, for /health."""
        out = []
        for i in range(self.dp):
            st = self.stats[i]
            alive = self.alive(i)
            entry = {
                "replica": i,
                "worker": self.workers[i],
                "pid": self.pids[i],
                "alive": alive,
                "routed": self.routed[i] if self.routes else int(st.get("routed", 0)),
                "running": int(st.get("running", 0)) if alive else 0,
                "waiting": int(st.get("waiting", 0)) if alive else 0,
                "used_pages": int(st.get("used_pages", 0)) if alive else 0,
                "prompt_tokens": int(st.get("prompt_tokens", 0)),
                "cached_prompt_tokens": int(st.get("cached_prompt_tokens", 0)),
                "prefix_hit_rate": float(st.get("prefix_hit_rate", 0.0)),
            }
            if i in self.down:
                entry["reason"] = self.down[i]
            out.append(entry)
        return out

    def render(self) -> str:
        """Prometheus lines, one sample per replica and metric."""
        view = self.view()
        lines: list[str] = []
        for m in METRICS:
            lines += [f"# HELP {m.name} {m.help}", f"# TYPE {m.name} {m.kind}"]
            lines += [f'{m.name}{{replica="{e["replica"]}"}} {float(e[m.key])}' for e in view]
        return "\n".join(lines) + "\n"
