"""Online benchmark: streaming chat completions against an OpenAI-compatible server.

Prompts are the profile's seeded random token prompts decoded to text with the model's
tokenizer (shared prefixes become the system message). Each request streams; the client
stamps every content chunk, which yields TTFT, TPOT, ITL and end-to-end latency per request,
and records the replica that served it when the server names one (`sse.Served`, `--dp N`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl.benchmark import common, observe
from minisgl.benchmark.observations import Observation
from minisgl.benchmark.offline import request_metrics
from minisgl.benchmark.profiles import Profile, WorkItem, build_workload
from minisgl.benchmark.sse import LeanClient, OpenAIClient, Served

KV_POLL_S = 0.2  # /metrics polling period for observations' KV pages (only with --observations)


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


async def _run(args, profile: Profile, prep: PreparedRun, prog, meter=None) -> dict[str, Any]:
    """Stream `prep`'s requests (after `profile.warmup_requests` unmeasured ones); `meter`: a
    CPU meter for the measured window (default: `CpuMeter` of --server-pid)."""
    base = args.base_url.rstrip("/")
    client = make_client(args)
    model, items, msgs = prep.model, prep.items, prep.messages
    async with client:
        sem = asyncio.Semaphore(profile.concurrency or len(items))
        # the connections the measured requests will use, opened outside the measurement (a
        # pooled client's steady state: no measured request pays a TCP handshake)
        await client.connect(min(profile.concurrency or len(items), len(items)))
        # warmup: a few requests outside the measurement
        warm = min(profile.warmup_requests, len(items))
        if warm:
            await asyncio.gather(
                *[
                    _one(
                        client,
                        model,
                        WorkItem(-1, [], 4),
                        msgs[i],
                        time.perf_counter(),
                        sem,
                        lambda n: None,
                    )
                    for i in range(warm)
                ]
            )
        advance = prog.task(f"online {profile.name}", len(items))
        if meter is None:
            meter = common.CpuMeter([args.server_pid] if args.server_pid else [])
        kv_samples: list[tuple[float, int]] = []
        with meter:
            t0 = time.perf_counter()
            poller = None
            if getattr(args, "observations", None):
                poller = asyncio.create_task(poll_kv(base, t0, kv_samples))
            outs = await asyncio.gather(
                *[
                    _one(client, model, it, m, t0, sem, advance)
                    for it, m in zip(items, msgs, strict=True)
                ]
            )
            duration = time.perf_counter() - t0
            if poller is not None:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
    token_times, out_tokens, errors, texts = [], [], [], []
    requests: list[StreamOutcome] = []
    in_tokens = 0
    for times, usage, error, text, served in outs:
        token_times.append(times)
        texts.append(text)
        out_tokens.append(usage.completion_tokens if usage else len(times))
        in_tokens += usage.prompt_tokens if usage else 0
        if error:
            errors.append(error)
        requests.append(
            StreamOutcome(
                times,
                text,
                error,
                usage.prompt_tokens if usage else None,
                usage.completion_tokens if usage else None,
                served.replica,
                served.replicas,
            )
        )
    metrics = request_metrics(items, token_times, out_tokens, duration)
    if in_tokens:  # what the server counted (chat template included)
        metrics["input_tokens"] = in_tokens
        metrics["total_tok_s"] = (in_tokens + metrics["output_tokens"]) / max(duration, 1e-9)
    metrics["cpu"] = dict(meter.result)
    metrics["errors"] = len(errors)
    metrics["chunks"] = sum(len(t) for t in token_times)  # SSE events with content
    if metrics["chunks"]:
        metrics["tokens_per_chunk"] = metrics["output_tokens"] / metrics["chunks"]
    return {
        "metrics": metrics,
        "token_times": token_times,
        "model": model,
        "tokenizer": prep.tokenizer,
        "error_samples": errors[:5],
        "texts": texts,
        "requests": requests,
        "kv_samples": kv_samples,
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
