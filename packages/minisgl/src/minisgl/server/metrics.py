"""Prometheus text exposition (no client library): histograms, counters, scheduler gauges."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minisgl.message.warmup import WarmUpReport

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts, strict=False):
            acc += c
            out.append(f'{self.name}_bucket{{le="{b}"}} {acc}')
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{self.name}_sum {self.sum}")
        out.append(f"{self.name}_count {self.count}")
        return out


def _esc(v: Any) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def flatten(prefix: str, obj: Any, out: list[tuple[str, float]]) -> None:
    if isinstance(obj, (bool, int | float)):
        out.append((prefix, float(obj)))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            flatten(f"{prefix}.{k}" if prefix else str(k), v, out)


class Metrics:
    def __init__(self) -> None:
        self.ttft = Histogram(
            "minisgl_time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS
        )
        self.tpot = Histogram(
            "minisgl_time_per_output_token_seconds",
            "Mean time per output token after the first.",
            TPOT_BUCKETS,
        )
        self.e2e = Histogram(
            "minisgl_e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS
        )
        self.requests: dict[str, int] = {}  # outcome -> count
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.aborted = 0

    def count_request(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def render(
        self,
        *,
        in_flight: int,
        healthy: bool,
        sched: dict[str, Any],
        warmup: WarmUpReport | None = None,
    ) -> str:
        lines = gauge("minisgl_healthy", "1 while every worker process is alive.", int(healthy))
        lines += gauge("minisgl_requests_in_flight", "Requests held by the API server.", in_flight)
        for name, help_, key, default, kind in SCHED_GAUGES:
            lines += gauge(name, help_, sched.get(key, default), kind)
        lines += gauge("minisgl_completion_tokens_total", "Tokens returned to clients.",
                       self.generated_tokens, "counter")  # fmt: skip
        if "spec_verify_rows" in sched:  # speculative decoding (--speculative-algorithm)
            lines += spec_gauges(sched)
        if warmup is not None:  # replica 0's engine, before the server reported healthy
            lines += gauge("minisgl_warmup_seconds", "Engine warm-up before ready.",
                           warmup.seconds)  # fmt: skip
            lines += gauge("minisgl_warmup_steps", "Scheduler steps of the engine warm-up.",
                           warmup.steps)  # fmt: skip
            lines += gauge("minisgl_warmup_requests", "Requests of the engine warm-up.",
                           warmup.requests)  # fmt: skip
        name = "minisgl_requests_total"
        lines += [f"# HELP {name} Finished requests by outcome.", f"# TYPE {name} counter"]
        for outcome, n in sorted(self.requests.items()):
            lines.append(f'{name}{{outcome="{_esc(outcome)}"}} {n}')
        for h in (self.ttft, self.tpot, self.e2e):
            lines += h.render()
        lines += cpu_backend_gauges(sched.get("cpu_backend"))
        return "\n".join(lines) + "\n"


def gauge(name: str, help_: str, value: float, kind: str = "gauge") -> list[str]:
    """One metric's lines: its HELP, its TYPE and its value."""
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]


# the scheduler's stats (`Stats`, summed over replicas) as metrics: name, help, the stats key,
# its value before the first stats, kind
SCHED_GAUGES: tuple[tuple[str, str, str, float, str], ...] = (
    ("minisgl_num_running_requests", "Requests admitted by the scheduler.", "running", 0, "gauge"),
    ("minisgl_num_queued_requests", "Requests waiting in the scheduler queue.", "waiting", 0,
     "gauge"),
    ("minisgl_kv_pages_total", "KV cache pages in the pool.", "total_pages", 0, "gauge"),
    ("minisgl_kv_pages_used", "KV pages not free (requests + prefix cache).", "used_pages", 0,
     "gauge"),
    ("minisgl_kv_pages_free", "Free KV pages.", "free_pages", 0, "gauge"),
    ("minisgl_kv_pages_cached", "KV pages held by the prefix cache.", "cached_pages", 0, "gauge"),
    ("minisgl_kv_integrity_ok", "1 if the last idle KV integrity check passed.", "integrity_ok",
     1, "gauge"),
    ("minisgl_kv_integrity_pending", "1 while the engine has not checked its KV pool since its "
     "last work (the check runs once it has been idle a moment).", "integrity_pending", 0,
     "gauge"),
    ("minisgl_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache.",
     "prefix_hit_rate", 0.0, "gauge"),
    ("minisgl_scheduler_steps_total", "Scheduler steps.", "steps", 0, "counter"),
    ("minisgl_generated_tokens_total", "Tokens generated by the engine.", "generated_tokens", 0,
     "counter"),
    ("minisgl_prompt_tokens_total", "Prompt tokens admitted.", "prompt_tokens", 0, "counter"),
    ("minisgl_cached_prompt_tokens_total", "Prompt tokens hit in the prefix cache.",
     "cached_prompt_tokens", 0, "counter"),
)  # fmt: skip


def spec_gauges(sched: dict[str, Any]) -> list[str]:
    """Speculative decoding's counters (summed over replicas) and the rates of the sums."""
    rows, drafted = sched["spec_verify_rows"], sched["spec_drafted_tokens"]
    accepted = sched["spec_accepted_tokens"]
    return [
        *gauge("minisgl_spec_drafted_tokens_total", "Draft tokens verified.", drafted, "counter"),
        *gauge("minisgl_spec_accepted_tokens_total", "Draft tokens accepted.", accepted,
               "counter"),
        *gauge("minisgl_spec_acceptance_rate", "Accepted / drafted tokens.",
               accepted / drafted if drafted else 0.0),
        *gauge("minisgl_spec_mean_accepted_length",
               "Tokens a verify row emits on average (accepted drafts + 1).",
               1 + accepted / rows if rows else 0.0),
    ]  # fmt: skip


def cpu_backend_gauges(cpu: Any) -> list[str]:
    """The CPU backend's path counters (one labelled line each) and its build information."""
    name = "minisgl_cpu_backend"
    lines = [
        f"# HELP {name} CPU backend path counters (minisgl.scheduler.cpu_backend).",
        f"# TYPE {name} gauge",
    ]
    if not isinstance(cpu, dict):
        return lines
    flat: list[tuple[str, float]] = []
    flatten("", cpu, flat)
    for path, v in flat:
        lines.append(f'{name}{{path="{_esc(path)}"}} {v}')
    info = {k: v for k, v in cpu.items() if isinstance(v, str)}
    if info:
        labels = ",".join(f'{k}="{_esc(v)}"' for k, v in sorted(info.items()))
        lines += [
            f"# HELP {name}_info CPU backend build information (labels).",
            f"# TYPE {name}_info gauge",
            f"{name}_info{{{labels}}} 1",
        ]
    return lines
