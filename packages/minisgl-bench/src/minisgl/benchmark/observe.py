"""Observations (`observations.py`) from the harness's runs: one per request and repeat.

Timing is the harness's own clock, the same numbers its latency metrics use:
- offline: a token's time is the end of the engine step that produced it (the step loop's
  clock, from the start of the run); TTFT = first token - arrival (the profile's arrival time,
  or 0 with --ignore-arrivals), ITL = gaps between the steps that produced consecutive tokens,
  e2e = last token - arrival. KV pages: the peak pages in use (requests + prefix cache)
  after any step between the request's arrival and its last token.
- online: the streaming client's clock: a token's time is when its SSE chunk arrived (several
  tokens in one chunk count once, so ITL is per chunk); TTFT, ITL and e2e as offline. KV pages:
  the peak of the server's `minisgl_kv_pages_used` gauge polled from /metrics (when polled)
  between the request's arrival and its last chunk. Replica: the data-parallel replica that
  served the request and the server's replica count, when the server named them (`sse.Served`;
  None offline, at dp=1 and for other servers).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from minisgl.benchmark.common import cpu_model
from minisgl.benchmark.observations import (
    Observation,
    fingerprint,
    request_id,
    workload_fingerprint,
)
from minisgl.benchmark.profiles import WorkItem


@dataclass(frozen=True)
class RunLabels:
    """What every observation of one run shares."""

    profile: str
    backend: str
    device: str
    model: str
    source: str
    repeat: int = 0
    extra: dict[str, object] = field(default_factory=dict)


def device_label(simulated: bool) -> str:
    """The device string: `cpu:<kind>` or the GPU name (the gates' hardware key), `sim:` before
    it for the simulated device."""
    from cardgate.hardware import hardware_key

    hw = hardware_key()
    return f"sim:{hw}" if simulated else hw


def kv_peak(samples: Sequence[tuple[float, int]], start: float, end: float) -> int | None:
    """The largest sample taken in [start, end] (or the last one before start when none)."""
    if not samples:
        return None
    times = [t for t, _ in samples]
    lo = bisect.bisect_left(times, start)
    hi = bisect.bisect_right(times, end)
    window = samples[lo:hi] or samples[max(lo - 1, 0) : max(lo, 1)]
    return max(v for _, v in window)


def build(
    items: Sequence[WorkItem],
    token_times: Sequence[Sequence[float]],
    labels: RunLabels,
    *,
    arrivals: Sequence[float] | None = None,
    token_ids: Sequence[Sequence[int]] | None = None,
    texts: Sequence[str] | None = None,
    errors: Sequence[str | None] | None = None,
    output_tokens: Sequence[int | None] | None = None,
    prompt_tokens: Sequence[int | None] | None = None,
    kv_samples: Sequence[tuple[float, int]] | None = None,
    replica: Sequence[int | None] | None = None,
    replicas: Sequence[int | None] | None = None,
) -> list[Observation]:
    extra = {"host_cpu": cpu_model(), **labels.extra}  # device says "cpu"; this says which
    out = []
    for k, (item, times) in enumerate(zip(items, token_times, strict=True)):
        arrival = arrivals[k] if arrivals is not None else item.arrival_s
        error = errors[k] if errors is not None else None
        if error is None and not times:
            error = "no output token"
        ids = tuple(token_ids[k]) if token_ids is not None else None
        text = texts[k] if texts is not None else None
        ok = error is None
        out.append(
            Observation(
                request_id=request_id(labels.profile, item.index),
                index=item.index,
                repeat=labels.repeat,
                backend=labels.backend,
                device=labels.device,
                model=labels.model,
                output_token_ids=ids if ok else None,
                output_text=text if ok else None,
                output_fingerprint=fingerprint(ids, text) if ok else None,
                workload_fingerprint=workload_fingerprint(item.prompt_ids, item.max_tokens),
                error=error,
                ttft_s=times[0] - arrival if ok else None,
                itl_s=tuple(b - a for a, b in itertools.pairwise(times)) if ok else (),
                e2e_s=times[-1] - arrival if ok else None,
                prompt_tokens=(
                    prompt_tokens[k] if prompt_tokens is not None else len(item.prompt_ids)
                ),
                output_tokens=output_tokens[k] if output_tokens is not None else len(times),
                kv_pages_in_use=(
                    kv_peak(kv_samples, arrival, times[-1]) if kv_samples and times else None
                ),
                source=labels.source,
                extra=extra,
                replica=replica[k] if replica is not None else None,
                replicas=replicas[k] if replicas is not None else None,
            )
        )
    return out
