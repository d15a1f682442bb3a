"""The online benchmark's lean streaming client: aiohttp and one `json.loads` a `data:` line.

What SGLang's `bench_serving` and vLLM's serving benchmark do, and a fraction of the openai
SDK's CPU a chunk (which builds a pydantic model of every chunk): on a 2-core machine the load
generator would otherwise be what a run measures. `--client openai` keeps the SDK path; both
send the same body and read the same stream (tested).

With `--dp N` (N > 1) a minisgl server names the replica that served each request: the
`X-Minisgl-Replica` header (sent with the stream's headers, so a stream that fails later still
says) and a `minisgl` object (`{"replica": k, "replicas": N}`) in the stream's finish and usage
chunks. Both clients record it in `Served` (None where the server does not say: dp=1, a peer).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DATA = b"data: "
DONE = b"[DONE]"
REPLICA_HEADER = "x-minisgl-replica"


@dataclass
class Served:
    """Which data-parallel replica of a minisgl server served a request, as the server said it
    (None: it did not say, e.g. dp=1 or another server)."""

    replica: int | None = None
    replicas: int | None = None  # the server's replica count

    def from_headers(self, headers: Mapping[str, str]) -> None:
        value = headers.get(REPLICA_HEADER)
        if value is not None and value.isdigit():
            self.replica = int(value)

    def from_extension(self, ext: Any) -> None:
        """The `minisgl` object of a chunk (or body), if it has one."""
        if not isinstance(ext, dict):
            return
        replica, replicas = ext.get("replica"), ext.get("replicas")
        if isinstance(replica, int) and not isinstance(replica, bool) and replica >= 0:
            self.replica = replica
        if isinstance(replicas, int) and not isinstance(replicas, bool) and replicas > 0:
            self.replicas = replicas


@dataclass(frozen=True)
class Usage:
    """The stream's `usage` (stream_options.include_usage), as the openai SDK names it."""

    prompt_tokens: int
    completion_tokens: int


class LeanClient:
    """`async with LeanClient(base_url, api_key, timeout) as c: await c.chat(...)`."""

    def __init__(self, base_url: str, api_key: str, timeout: float) -> None:
        self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self.timeout = timeout
        self.session: Any = None

    async def __aenter__(self) -> LeanClient:
        import aiohttp

        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=0),  # concurrency is the profile's semaphore
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()

    async def connect(self, n: int) -> None:
        """Open `n` keep-alive connections (concurrent GET /health), left in the pool."""
        url = self.url.removesuffix("/v1/chat/completions") + "/health"

        async def one() -> None:
            async with self.session.get(url, headers=self.headers) as r:
                await r.read()

        await asyncio.gather(*(one() for _ in range(n)))

    async def chat(
        self,
        body: dict[str, Any],
        t0: float,
        times: list[float],
        parts: list[str],
        served: Served | None = None,
    ) -> Usage | None:
        """Stream one chat completion: every content chunk's arrival (seconds from `t0`) into
        `times`, its text into `parts`, the replica that served it into `served`; returns the
        usage. An HTTP error or an error event raises `RuntimeError`."""
        usage = None
        async with self.session.post(self.url, data=json.dumps(body), headers=self.headers) as r:
            if served is not None:
                served.from_headers(r.headers)
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
            async for line in r.content:
                if not line.startswith(DATA):
                    continue
                payload = line[len(DATA) :].strip()
                if payload == DONE:
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise RuntimeError(f"error event: {chunk['error']}")
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        times.append(time.perf_counter() - t0)
                        parts.append(content)
                u = chunk.get("usage")
                if u:
                    usage = Usage(int(u["prompt_tokens"]), int(u["completion_tokens"]))
                if served is not None and "minisgl" in chunk:
                    served.from_extension(chunk["minisgl"])
        return usage


class OpenAIClient:
    """The same `chat` through the openai SDK's `AsyncOpenAI` (`--client openai`)."""

    def __init__(self, base_url: str, api_key: str, timeout: float) -> None:
        from openai import AsyncOpenAI

        self.client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, timeout=timeout)

    async def __aenter__(self) -> OpenAIClient:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.__aexit__(*exc)

    async def connect(self, n: int) -> None:
        """Open `n` keep-alive connections of the SDK's pool (concurrent GET /v1/models)."""
        await asyncio.gather(*(self.client.models.list() for _ in range(n)))

    async def chat(
        self,
        body: dict[str, Any],
        t0: float,
        times: list[float],
        parts: list[str],
        served: Served | None = None,
    ) -> Any:
        extra = {"ignore_eos": body["ignore_eos"]}
        std = {k: v for k, v in body.items() if k != "ignore_eos"}
        stream = await self.client.chat.completions.create(**std, extra_body=extra)
        if served is not None:
            served.from_headers(stream.response.headers)
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if served is not None:  # the SDK keeps unknown fields (pydantic extra="allow")
                served.from_extension((chunk.model_extra or {}).get("minisgl"))
            for choice in chunk.choices or []:
                if choice.delta and choice.delta.content:
                    times.append(time.perf_counter() - t0)
                    parts.append(choice.delta.content)
        return usage
