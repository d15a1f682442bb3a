"""Offline runs of one workload: minisgl's `LLM` (step loop honouring arrival times) and the HF
transformers `generate` baseline (batched, left-padded, KV cache on)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minisgl.benchmark.common import CpuMeter, percentiles
from minisgl.benchmark.profiles import Profile, WorkItem

if TYPE_CHECKING:
    from minisgl.scheduler.request import StepOutput
    from minisgl.scheduler.stats import SchedulerStats

Progress = Callable[[int], None]  # called with the number of requests just finished


def request_metrics(
    items: Sequence[WorkItem],
    token_times: Sequence[Sequence[float]],
    out_tokens: Sequence[int],
    duration_s: float,
) -> dict[str, Any]:
    """Throughput and latency metrics from per-request token timestamps (seconds from start).

    TTFT = first token - arrival; e2e = last token - arrival; TPOT = (e2e - TTFT) / (n - 1)
    with n the request's output tokens (`out_tokens`: online, the server's usage), not its
    timestamps: a stream that coalesces tokens into fewer chunks has fewer stamps than tokens;
    ITL = every gap between consecutive stamps of one request (online: between chunks).
    """
    ttft, tpot, e2e, itl = [], [], [], []
    for item, times, n in zip(items, token_times, out_tokens, strict=True):
        if not times:
            continue
        ttft.append(times[0] - item.arrival_s)
        e2e.append(times[-1] - item.arrival_s)
        tokens = max(int(n), len(times))
        if tokens > 1:
            tpot.append((times[-1] - times[0]) / (tokens - 1))
        if len(times) > 1:
            itl.extend(b - a for a, b in itertools.pairwise(times))
    n_out = int(sum(out_tokens))
    n_in = int(sum(len(i.prompt_ids) for i in items))
    dur = max(duration_s, 1e-9)
    return {
        "num_requests": len(items),
        "completed": sum(1 for t in token_times if t),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "duration_s": duration_s,
        "output_tok_s": n_out / dur,
        "total_tok_s": (n_in + n_out) / dur,
        "request_s": len(items) / dur,
        "ttft_ms": percentiles(ttft, 1e3),
        "tpot_ms": percentiles(tpot, 1e3),
        "itl_ms": percentiles(itl, 1e3),
        "e2e_ms": percentiles(e2e, 1e3),
    }


def longest_steps(step_s: Sequence[float], top: int = 5) -> list[dict[str, float | int]]:
    """The `top` longest of a run's step wall times (seconds): `{"step": index, "ms": ...}`,
    longest first. A compile or an allocation mid-run shows here, not in the percentiles."""
    order = sorted(range(len(step_s)), key=lambda i: step_s[i], reverse=True)[:top]
    return [{"step": i, "ms": step_s[i] * 1e3} for i in order]


def add_cpu_efficiency(metrics: dict[str, Any]) -> None:
    """Output tokens per CPU-second of this process: robust when other jobs share the cores."""
    cpu_s = (metrics.get("cpu") or {}).get("client_cpu_s")
    if cpu_s:
        metrics["output_tok_per_cpu_s"] = metrics["output_tokens"] / cpu_s


def make_llm(model_path: str | None, profile: Profile, llm_kwargs: dict[str, Any]):
    from minisgl.llm import LLM

    kw: dict[str, Any] = {
        "max_running_requests": profile.max_running_requests,
        "max_extend_tokens": profile.max_extend_tokens,
    }
    kw.update(llm_kwargs)
    return LLM(model_path, **kw)


def flush_prefix_cache(llm) -> bool:
    """Drop everything the prefix cache holds, so repeats do not hit the previous repeat's KV.

    False when the scheduler backend offers no way to do it (the Rust backend keeps its pages
    inside the extension); the A/B mode runs every arm in a fresh process, so it never needs it.
    """
    sched = llm.scheduler
    flush = getattr(sched, "flush_cache", None)
    if callable(flush):
        flush()
        return True
    free = getattr(getattr(sched, "alloc", None), "free_locations", None)
    if free is None:
        return False
    size = sched.cache.evictable_size
    if size:
        free(sched.cache.evict(size))
    return True


class _ServiceMeter:
    """`rust_service`: the control plane's figures come from the service process (its `Stats`
    counters and its CPU time), not from this process's idle scheduler."""

    def __init__(self, plane: Any) -> None:
        self.plane = plane

    def kv_usage(self) -> dict[str, int]:
        s = self.plane.stats
        keys = ("total_pages", "free_pages", "running", "waiting")
        return {k: int(s.get(k, 0)) for k in keys}

    def counters(self) -> dict[str, float]:
        s = self.plane.fresh_stats()
        c = (s.get("cpu_backend") or {}).get("service") or {}
        return {
            "cpu_s": self.plane.service_cpu_s(),
            "steps": c.get("steps", 0),
            "control_us": c.get("schedule_us", 0) + c.get("commit_us", 0),
            "ingress_us": c.get("ingress_us", 0),
            "prompt_tokens": s.get("prompt_tokens", 0),
            "cached_prompt_tokens": s.get("cached_prompt_tokens", 0),
        }

    def metrics(self, before: dict[str, float], duration: float) -> dict[str, Any]:
        d = {k: v - before[k] for k, v in self.counters().items()}
        steps = max(d["steps"], 1)
        return {
            "steps": int(d["steps"]),
            "sched_step_cpu_ms": {"mean": d["control_us"] / steps / 1e3},
            "sched_cpu_share_pct": 100.0 * d["control_us"] / 1e6 / max(duration, 1e-9),
            "prefix_hit_rate": (
                d["cached_prompt_tokens"] / d["prompt_tokens"] if d["prompt_tokens"] else 0.0
            ),
            "service_cpu_s": d["cpu_s"],
            "service_ingress_ms": d["ingress_us"] / 1e3,
        }


def _service(llm) -> _ServiceMeter | None:
    plane = llm.runtime.plane
    return _ServiceMeter(plane) if llm.runtime.service_pid is not None else None


@dataclass(frozen=True)
class _StatsMark:
    """Where the scheduler's cumulative stats stood when a run began: the run's share is what
    came after."""

    schedule: int
    commit: int
    prompt_tokens: int
    cached_prompt_tokens: int

    @classmethod
    def of(cls, stats: SchedulerStats) -> _StatsMark:
        """The mark of `stats` now."""
        return cls(
            schedule=len(stats.schedule_s),
            commit=len(stats.commit_s),
            prompt_tokens=stats.prompt_tokens,
            cached_prompt_tokens=stats.cached_prompt_tokens,
        )

    def scheduler_metrics(self, stats: SchedulerStats, duration: float) -> dict[str, Any]:
        """The run's scheduler CPU time: its steps, the schedule + commit time a step and
        each part's, and their share of the run's wall time."""
        sched_s = stats.schedule_s[self.schedule :]
        commit_s = stats.commit_s[self.commit :]
        steps = [a + b for a, b in zip(sched_s, commit_s, strict=False)]
        return {
            "steps": len(steps),
            "sched_step_cpu_ms": percentiles(steps, 1e3),
            "schedule_cpu_ms": percentiles(sched_s, 1e3),
            "commit_cpu_ms": percentiles(commit_s, 1e3),
            "sched_cpu_share_pct": 100.0 * sum(steps) / max(duration, 1e-9),
        }

    def prefix_hit_rate(self, stats: SchedulerStats) -> float:
        """The run's cached prompt tokens over its prompt tokens (0.0 without prompts)."""
        prompt_tokens = stats.prompt_tokens - self.prompt_tokens
        cached = stats.cached_prompt_tokens - self.cached_prompt_tokens
        return cached / prompt_tokens if prompt_tokens else 0.0


class _RunLog:
    """What one `run_minisgl` run records as it steps: every request's token times (seconds
    from the start), ids and count, the KV pages used after every step, every step's wall
    time, and the peaks of KV pages, running and waiting requests."""

    def __init__(self, n_items: int, total_pages: int) -> None:
        self.token_times: list[list[float]] = [[] for _ in range(n_items)]
        self.token_ids: list[list[int]] = [[] for _ in range(n_items)]
        self.out_tokens = [0] * n_items
        self.kv_samples: list[tuple[float, int]] = []  # (time, KV pages used) after every step
        self.step_s: list[float] = []  # wall time of every `llm.step()`
        self.total_pages = total_pages
        self.peak_used = self.peak_running = self.peak_waiting = 0

    def record_step(self, t: float, wall_s: float, usage: Mapping[str, int]) -> None:
        """Adds one step that ended at `t` and took `wall_s`, with the KV usage after it."""
        used = usage["total_pages"] - usage["free_pages"]
        self.step_s.append(wall_s)
        self.kv_samples.append((t, used))
        self.peak_used = max(self.peak_used, used)
        self.peak_running = max(self.peak_running, usage["running"])
        self.peak_waiting = max(self.peak_waiting, usage["waiting"])

    def record_outputs(self, outs: Sequence[StepOutput], index: dict[int, int], t: float) -> int:
        """Adds a step's tokens (at `t`) to their requests (`index`: rid -> item); returns how
        many requests finished. Outputs of requests not in `index` are left out."""
        finished = 0
        for out in outs:
            i = index.get(out.rid)
            if i is None:
                continue
            self.token_times[i].append(t)
            self.token_ids[i].append(out.token_id)
            self.out_tokens[i] += 1
            if out.finish_reason is not None:
                finished += 1
        return finished

    def step_metrics(self) -> dict[str, Any]:
        """The run's step wall times, its longest steps and its peaks."""
        return {
            "step_wall_ms": percentiles(self.step_s, 1e3),
            "longest_steps": longest_steps(self.step_s),
            "peak_kv_usage": self.peak_used / self.total_pages,
            "peak_kv_pages": self.peak_used,
            "kv_total_pages": self.total_pages,
            "peak_running": self.peak_running,
            "peak_waiting": self.peak_waiting,
        }


def _submit(llm, item: WorkItem) -> int:
    """Adds `item` as a greedy request of `max_tokens` tokens (EOS ignored); returns its rid."""
    from minisgl.core import SamplingParams
    from minisgl.sampler import request_key

    params = SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True)
    return llm.runtime.add(item.prompt_ids, params, generator=request_key(params.seed))


def _step_until_done(
    llm,
    items: Sequence[WorkItem],
    log: _RunLog,
    progress: Progress | None,
    honor_arrivals: bool,
    service: _ServiceMeter | None,
) -> float:
    """Submits `items` at their arrival times (all at once without `honor_arrivals`) and steps
    until every one finished, into `log`; returns the seconds that took."""
    order = sorted(range(len(items)), key=lambda i: items[i].arrival_s)
    index: dict[int, int] = {}
    pos, done = 0, 0
    t0 = time.perf_counter()
    while done < len(items):
        now = time.perf_counter() - t0
        while pos < len(order) and (not honor_arrivals or items[order[pos]].arrival_s <= now):
            index[_submit(llm, items[order[pos]])] = order[pos]
            pos += 1
        if not llm.has_work():  # requests, or steps in flight (overlap scheduling)
            time.sleep(max(0.0, min(items[order[pos]].arrival_s - now, 0.05)))
            continue
        t_step = time.perf_counter()
        outs = llm.step()
        t_done = time.perf_counter()
        usage = llm.scheduler.kv_usage() if service is None else service.kv_usage()
        log.record_step(t_done - t0, t_done - t_step, usage)
        finished = log.record_outputs(outs, index, t_done - t0)
        done += finished
        if finished and progress:
            progress(finished)
    return time.perf_counter() - t0


def run_minisgl(
    llm,
    items: Sequence[WorkItem],
    progress: Progress | None = None,
    honor_arrivals: bool = True,
) -> dict[str, Any]:
    """Feed `items` into the scheduler at their arrival times and step until all finish."""
    flushed = flush_prefix_cache(llm)
    stats = llm.scheduler.stats
    service = _service(llm)
    svc0 = service.counters() if service is not None else None
    mark = _StatsMark.of(stats)
    log = _RunLog(len(items), max(llm.scheduler.kv_usage()["total_pages"], 1))
    meter = CpuMeter()
    with meter:
        duration = _step_until_done(llm, items, log, progress, honor_arrivals, service)
        llm.sync()  # overlap scheduling: commit the steps after the last finish (all dropped)
    metrics = request_metrics(items, log.token_times, log.out_tokens, duration)
    metrics.update(
        {
            **mark.scheduler_metrics(stats, duration),
            **log.step_metrics(),
            "prefix_hit_rate": mark.prefix_hit_rate(stats),
            "prefix_cache_flushed": flushed,
            "cpu": meter.result,
        }
    )
    if service is not None and svc0 is not None:
        metrics.update(service.metrics(svc0, duration))
    add_cpu_efficiency(metrics)
    return {
        "metrics": metrics,
        "token_times": log.token_times,
        "token_ids": log.token_ids,
        "kv_samples": log.kv_samples,
    }


def _generate_stamped(
    model, batch: list[WorkItem], pad_token_id: int, device: Any, stamp: Any
) -> list[float]:
    """HF greedy `generate` of one batch, left-padded, every request the batch's longest
    `max_tokens`; returns the clock of every decoding step (`stamp`'s; [end] when none)."""
    import torch
    from transformers import LogitsProcessorList

    width = max(len(i.prompt_ids) for i in batch)
    ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, item in enumerate(batch):
        n = len(item.prompt_ids)
        ids[row, width - n :] = torch.tensor(item.prompt_ids)
        mask[row, width - n :] = 1
    new = max(i.max_tokens for i in batch)
    model.generate(
        ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        use_cache=True,
        pad_token_id=pad_token_id,
        logits_processor=LogitsProcessorList([stamp]),
    )
    end = time.perf_counter()
    # the processor runs right after the forward that yields token k (argmax follows)
    return stamp.times or [end]


def run_hf(
    model,
    items: Sequence[WorkItem],
    batch_size: int,
    pad_token_id: int,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """HF `generate`, greedy, in batches of `batch_size` (left padding, KV cache on).

    Arrival times are ignored (all requests are offline); a logits processor stamps every
    decoding step so TTFT / ITL come from the same clock as minisgl's.
    """
    import torch
    from transformers import LogitsProcessor

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    device = next(model.parameters()).device
    token_times: list[list[float]] = [[] for _ in items]
    out_tokens = [0] * len(items)
    meter = CpuMeter()
    with meter, torch.inference_mode():
        t0 = time.perf_counter()
        for start in range(0, len(items), batch_size):
            batch = list(items[start : start + batch_size])
            stamps = _generate_stamped(model, batch, pad_token_id, device, Stamp())
            for k, item in enumerate(batch):
                n = min(item.max_tokens, len(stamps))
                token_times[start + k] = [s - t0 for s in stamps[:n]]
                out_tokens[start + k] = n
            if progress:
                progress(len(batch))
        duration = time.perf_counter() - t0
    metrics = request_metrics(items, token_times, out_tokens, duration)
    metrics["hf_batch_size"] = batch_size
    metrics["cpu"] = meter.result
    add_cpu_efficiency(metrics)
    return {"metrics": metrics, "token_times": token_times}


def load_hf(model_path: str, dtype: str = "float32", dummy: bool = False, device: str = "cpu"):
    from minisgl.testing.hf_reference import load_hf_model

    return load_hf_model(model_path, dtype=dtype, device=device, dummy=dummy)
