"""Online benchmark: streaming chat completions against an OpenAI-compatible server.

Prompts are the profile's seeded random token prompts decoded to text with the model's
tokenizer (shared prefixes become the system message). Each request streams; the client
stamps every content chunk, which yields TTFT, TPOT, ITL and end-to-end latency per request,
and records the replica that served it when the server names one (`sse.Served`, `--dp N`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl.benchmark import common, observe
from minisgl.benchmark.observations import Observation
from minisgl.benchmark.offline import request_metrics
from minisgl.benchmark.profiles import Profile, WorkItem, build_workload
from minisgl.benchmark.sse import LeanClient, OpenAIClient, Served

KV_POLL_S = 0.2  # /metrics polling period for observations' KV pages (only with --observations)
Client = LeanClient | OpenAIClient  # the load generator (`make_client`)


@dataclass(frozen=True)
class StreamOutcome:
    """One streamed request as the client saw it."""

    times: list[float]  # arrival of every content chunk, seconds from the run's start
    text: str
    error: str | None
    prompt_tokens: int | None  # what the server counted (usage), chat template included
    completion_tokens: int | None
    replica: int | None = None  # the replica that served it, when the server said (dp > 1)
    replicas: int | None = None  # the server's replica count, when it said


async def poll_kv(base_url: str, t0: float, samples: list[tuple[float, int]]) -> None:
    """Append (time, minisgl_kv_pages_used) from /metrics every KV_POLL_S until cancelled."""
    import httpx

    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                text = (await client.get(f"{base_url}/metrics")).text
                for line in text.splitlines():
                    if line.startswith("minisgl_kv_pages_used "):
                        samples.append((time.perf_counter() - t0, int(float(line.split()[1]))))
            await asyncio.sleep(KV_POLL_S)


def _tokenizer(model_path: str | None, served_name: str):
    from transformers import AutoTokenizer

    for candidate in (model_path, served_name):
        if candidate and Path(candidate, "tokenizer_config.json").exists():
            return AutoTokenizer.from_pretrained(candidate), candidate
    from minisgl.default_model import default_model_path

    path = str(default_model_path())
    return AutoTokenizer.from_pretrained(path), path


def messages_for(item: WorkItem, profile: Profile, tok) -> list[dict[str, str]]:
    ids = item.prompt_ids
    msgs = []
    if item.prefix_id >= 0:
        msgs.append({"role": "system", "content": tok.decode(ids[: profile.prefix_len])})
        ids = ids[profile.prefix_len :]
    msgs.append({"role": "user", "content": tok.decode(ids)})
    return msgs


def request_body(model: str, item: WorkItem, messages) -> dict[str, Any]:
    """The streamed chat request of `item` (both clients send this)."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": item.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


async def _one(client, model: str, item: WorkItem, messages, t0: float, sem, advance):
    async with sem:
        now = time.perf_counter() - t0
        if item.arrival_s > now:
            await asyncio.sleep(item.arrival_s - now)
        times: list[float] = []
        parts: list[str] = []
        usage = None
        error = None
        served = Served()
        body = request_body(model, item, messages)
        try:
            usage = await client.chat(body, t0, times, parts, served)
        except Exception as exc:
            error = repr(exc)
        advance(1)
        return times, usage, error, "".join(parts), served


def make_client(args):
    """The load generator `args.client` names: `lean` (default) or the openai SDK."""
    base = args.base_url.rstrip("/")
    kind = OpenAIClient if getattr(args, "client", "lean") == "openai" else LeanClient
    return kind(base, args.api_key, args.timeout)


@dataclass(frozen=True)
class PreparedRun:
    """What the harness process prepares for the client process (which then needs no
    tokenizer): the served model, the tokenizer's folder name, the workload, its messages."""

    model: str
    tokenizer: str
    items: list[WorkItem]
    messages: list[list[dict[str, str]]]


def served_model(base_url: str, api_key: str) -> str:
    """The first model of the server's /v1/models."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"}
    resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def prepare(args, profile: Profile) -> PreparedRun:
    """The served model (`--model`, else the first of /v1/models), its tokenizer, the profile's
    workload in its vocabulary and the chat messages of every request."""
    model = args.model or served_model(args.base_url, args.api_key)
    tok, tok_path = _tokenizer(args.model_path, model)
    items = build_workload(profile, len(tok))
    msgs = [messages_for(it, profile, tok) for it in items]
    return PreparedRun(model, Path(tok_path).name, items, msgs)


@dataclass(frozen=True)
class MeasuredWindow:
    """The measured requests as they streamed (in workload order), the window's seconds and
    the KV pages polled from /metrics in it (only with --observations)."""

    requests: list[StreamOutcome]
    duration: float
    kv_samples: list[tuple[float, int]]


def _outcome(
    times: list[float], usage: Any, error: str | None, text: str, served: Served
) -> StreamOutcome:
    """The `StreamOutcome` of one `_one` result (`usage`: the stream's, None when it sent
    none)."""
    return StreamOutcome(
        times,
        text,
        error,
        usage.prompt_tokens if usage else None,
        usage.completion_tokens if usage else None,
        served.replica,
        served.replicas,
    )


async def _warm_up(client: Client, prep: PreparedRun, n: int, sem: asyncio.Semaphore) -> None:
    """Streams `n` short requests (4 tokens, the first `n` messages) outside the measurement;
    returns None."""
    if n:
        await asyncio.gather(
            *[
                _one(
                    client,
                    prep.model,
                    WorkItem(-1, [], 4),
                    prep.messages[i],
                    time.perf_counter(),
                    sem,
                    lambda n: None,
                )
                for i in range(n)
            ]
        )


async def _measure(
    args: argparse.Namespace,
    client: Client,
    prep: PreparedRun,
    sem: asyncio.Semaphore,
    advance: Callable[[int], None],
    meter: Any,  # a CpuMeter, or the client process's RoleCpuMeter
) -> MeasuredWindow:
    """Streams every request of `prep` at its arrival time inside `meter` (polling /metrics
    for KV pages with --observations); returns the `MeasuredWindow`."""
    kv_samples: list[tuple[float, int]] = []
    with meter:
        t0 = time.perf_counter()
        poller = None
        if getattr(args, "observations", None):
            poller = asyncio.create_task(poll_kv(args.base_url.rstrip("/"), t0, kv_samples))
        outs = await asyncio.gather(
            *[
                _one(client, prep.model, it, m, t0, sem, advance)
                for it, m in zip(prep.items, prep.messages, strict=True)
            ]
        )
        duration = time.perf_counter() - t0
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
    return MeasuredWindow([_outcome(*o) for o in outs], duration, kv_samples)


def _stream_metrics(
    items: list[WorkItem], requests: list[StreamOutcome], duration: float, cpu: dict[str, Any]
) -> dict[str, Any]:
    """`request_metrics` of the streamed requests, the input tokens the server counted (chat
    template included) when it said, the CPU figures, the errors and the content chunks."""
    token_times = [r.times for r in requests]
    out_tokens = [len(r.times) if r.completion_tokens is None else r.completion_tokens
                  for r in requests]  # fmt: skip
    in_tokens = sum(r.prompt_tokens or 0 for r in requests)
    metrics = request_metrics(items, token_times, out_tokens, duration)
    if in_tokens:  # what the server counted (chat template included)
        metrics["input_tokens"] = in_tokens
        metrics["total_tok_s"] = (in_tokens + metrics["output_tokens"]) / max(duration, 1e-9)
    metrics["cpu"] = dict(cpu)
    metrics["errors"] = sum(1 for r in requests if r.error)
    metrics["chunks"] = sum(len(t) for t in token_times)  # SSE events with content
    if metrics["chunks"]:
        metrics["tokens_per_chunk"] = metrics["output_tokens"] / metrics["chunks"]
    return metrics


async def _run(args, profile: Profile, prep: PreparedRun, prog, meter=None) -> dict[str, Any]:
    """Stream `prep`'s requests (after `profile.warmup_requests` unmeasured ones); `meter`: a
    CPU meter for the measured window (default: `CpuMeter` of --server-pid)."""
    client = make_client(args)
    items = prep.items
    async with client:
        sem = asyncio.Semaphore(profile.concurrency or len(items))
        # the connections the measured requests will use, opened outside the measurement (a
        # pooled client's steady state: no measured request pays a TCP handshake)
        await client.connect(min(profile.concurrency or len(items), len(items)))
        await _warm_up(client, prep, min(profile.warmup_requests, len(items)), sem)
        advance = prog.task(f"online {profile.name}", len(items))
        if meter is None:
            meter = common.CpuMeter([args.server_pid] if args.server_pid else [])
        window = await _measure(args, client, prep, sem, advance, meter)
    requests = window.requests
    return {
        "metrics": _stream_metrics(items, requests, window.duration, meter.result),
        "token_times": [r.times for r in requests],
        "model": prep.model,
        "tokenizer": prep.tokenizer,
        "error_samples": [r.error for r in requests if r.error][:5],
        "texts": [r.text for r in requests],
        "requests": requests,
        "kv_samples": window.kv_samples,
    }


def stream_observations(out: dict[str, Any], labels: observe.RunLabels) -> list[Observation]:
    """Observations of one online run (`_run_with_items`'s output; see `observe.py`)."""
    reqs: list[StreamOutcome] = out["requests"]
    return observe.build(
        out["items"],
        [r.times for r in reqs],
        labels,
        texts=[r.text for r in reqs],
        errors=[r.error for r in reqs],
        output_tokens=[r.completion_tokens for r in reqs],
        prompt_tokens=[r.prompt_tokens for r in reqs],
        kv_samples=out["kv_samples"],
        replica=[r.replica for r in reqs],
        replicas=[r.replicas for r in reqs],
    )


def server_backend(base_url: str) -> str:
    """The CPU backend a running server reports on /health ("unknown" when it does not)."""
    import httpx

    with contextlib.suppress(httpx.HTTPError, ValueError):
        health = httpx.get(base_url.rstrip("/") + "/health", timeout=5).json()
        return str(health.get("cpu_backend") or "unknown")
    return "unknown"


async def _run_with_items(
    args, profile: Profile, prog, meter=None, prep: PreparedRun | None = None
) -> dict[str, Any]:
    """One run: `_run`'s output with the workload's `items` (`prep`: default `prepare`d here)."""
    if prep is None:
        prep = prepare(args, profile)
    out = await _run(args, profile, prep, prog, meter)
    out["items"] = prep.items
    return out
