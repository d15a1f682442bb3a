"""A streamed request's SSE events: the role chunks, each output's text (reasoning and tool-call
deltas split out, logprobs on the first chunk), each choice's finish chunk, the usage and
`[DONE]`. `streaming.py` holds the response that sends them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from minisgl.reasoning.formats import NOTHING
from minisgl.server.frontend import ClientGone, Frontend, Job, next_item
from minisgl.server.mailbox import Accepted, Chunk, Failure, Item
from minisgl.server.protocol import Parsed
from minisgl.server.responses import (
    Reply,
    chat_logprobs,
    completion_logprobs,
    error_response,
    usage,
)
from minisgl.server.streaming import ClosingStreamingResponse, FinalChunk
from minisgl.tools import ArgsDelta, CallStart, ContentDelta, Event, ToolCallParser

# Raw in JSON strings, yet line ends to `str.splitlines` (httpx's `iter_lines`) and JavaScript:
# escaped, so an event is one line for every client. orjson escapes the C0 controls itself.
_LINE_ENDS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def sse(obj: Any) -> bytes:
    """One `data:` event. orjson: ~10x faster than `json.dumps` for a chunk (0.7 vs 6.7 us);
    the same bytes for ASCII text, UTF-8 (not `\\u` escapes) otherwise, but for U+0085, U+2028
    and U+2029 (see `_LINE_ENDS`); a non-finite float becomes null, never invalid JSON."""
    body = orjson.dumps(obj)
    if not body.isascii():
        for raw, escaped in _LINE_ENDS:
            body = body.replace(raw, escaped)
    return b"data: " + body + b"\n\n"


def event_delta(ev: Event) -> dict:
    """A tool-call parser event as an OpenAI stream delta."""
    if isinstance(ev, ContentDelta):
        return {"content": ev.text}
    if isinstance(ev, CallStart):
        call = {"index": ev.index, "id": ev.id, "type": "function",
                "function": {"name": ev.name, "arguments": ""}}  # fmt: skip
        return {"tool_calls": [call]}
    assert isinstance(ev, ArgsDelta)
    return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}


class Stream:
    """One streamed request's chunks, and what they keep per choice: the characters sent
    (completions' logprob offsets), its tool-call parser and reasoning split, whether it
    called a tool."""

    def __init__(self, fe: Frontend, job: Job, parsed: Parsed, reply: Reply) -> None:
        self.fe = fe
        self.job = job
        self.reply = reply
        self.obj = "chat.completion.chunk" if reply.chat else "text_completion"
        self.include_usage = parsed.include_usage
        self.continuous_usage = parsed.continuous_usage
        n = len(job.states)
        self.offsets = [0] * n  # completions: characters sent per choice
        self.parsers = [ToolCallParser(reply.tools) if reply.tools else None for _ in range(n)]
        self.thinks = [reply.think.stream() if reply.think else None for _ in range(n)]
        self.called = [False] * n

    def chunk(
        self,
        index: int,
        text: str | None,
        fin: str | None,
        role: bool = False,
        lp: list | None = None,
        tool: dict | None = None,
    ) -> bytes:
        if self.reply.chat:
            delta: dict[str, Any] = dict(tool or {})
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            lps = chat_logprobs(lp) if lp else None
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": fin}
        else:
            lps = completion_logprobs(lp, self.offsets[index]) if lp else None
            self.offsets[index] += len(text or "")
            choice = {"index": index, "text": text or "", "logprobs": lps, "finish_reason": fin}
        out = self.reply.envelope([choice], self.obj)
        if self.continuous_usage:
            out["usage"] = usage(self.job)
        elif self.include_usage:
            out["usage"] = None
        if fin is not None:  # a choice's last chunk names the replica (dp > 1)
            served = self.fe.served(self.job)
            if served is not None:
                out["minisgl"] = served
        return sse(out)

    def roles(self) -> list[bytes]:
        """Chat: every choice's first chunk, the assistant role."""
        return [self.chunk(s.index, "", None, role=True) for s in self.job.states]

    def output(self, item: Chunk) -> list[bytes]:
        """The chunks of one output's text: the reasoning first, then the content or the
        tool-call deltas (logprobs on the first chunk); none for nothing printable."""
        out: list[bytes] = []
        i, text, lp = item.index, item.text, item.logprobs
        think = self.thinks[i]
        if think is not None:  # the reasoning first; the rest is the content
            reasoning, text = think.feed(text) if text else NOTHING
            if item.finish is not None:
                more = think.finish()
                reasoning, text = reasoning + more.reasoning, text + more.content
            if reasoning:
                out.append(self.chunk(i, None, None, lp=lp, tool={"reasoning_content": reasoning}))
                lp = None
        parser = self.parsers[i]
        if parser is not None:  # tool calls: parser events, logprobs on the first
            events = parser.feed(text) if text else []
            if item.finish is not None:
                events += parser.finish()
            for ev in events:
                self.called[i] |= isinstance(ev, CallStart)
                out.append(self.chunk(i, None, None, lp=lp, tool=event_delta(ev)))
                lp = None
            if lp:
                out.append(self.chunk(i, None, None, lp=lp))
        elif text or lp:
            out.append(self.chunk(i, text, None, lp=lp))
        return out

    def finish(self, item: Chunk) -> bytes:
        """A choice's finish chunk ("tool_calls" for a choice that stopped after calling)."""
        fin = item.finish
        if self.called[item.index] and fin == "stop":
            fin = "tool_calls"
        return self.chunk(item.index, None if self.reply.chat else "", fin)

    def usage(self) -> bytes:
        """The last chunk, with stream_options.include_usage: the request's usage."""
        out = self.reply.envelope([], self.obj)
        out["usage"] = usage(self.job)
        served = self.fe.served(self.job)
        if served is not None:
            out["minisgl"] = served
        return sse(out)


async def events(s: Stream, first: Item, stack: contextlib.AsyncExitStack) -> AsyncIterator[bytes]:
    """The stream's body. Only `data:` lines: peer clients json.loads every non-empty line (the
    headers go out as the response starts, once the scheduler queued the request). What one
    output adds goes out in one write: the role chunks with the first text, a choice's finish
    chunk with its last text, the usage, [DONE] and the body's end with the last one. The role
    chunks are made with the first output, which says the prompt's length (their usage,
    stream_options.continuous_usage_stats, counts it)."""
    fe, job = s.fe, s.job
    item: Item = first
    left = len(job.states)
    roles = s.reply.chat
    out: list[bytes] = []
    try:
        while True:
            st = job.states[item.index]
            if isinstance(item, Accepted):
                item = await next_item(job)
                continue
            if roles:
                out = s.roles()
                roles = False
            if isinstance(item, Failure):
                fe.settle(st)
                fe.complete(job, "error")
                out.append(sse(s.reply.error(item.error).body()))
                break
            out += s.output(item)
            if item.finish is not None:
                fe.settle(st)
                out.append(s.finish(item))
                left -= 1
                if not left:
                    fe.complete(job, "ok")
                    if s.include_usage:
                        out.append(s.usage())
                    break
            if out:
                yield b"".join(out)
                out = []
            item = await next_item(job)
        out.append(b"data: [DONE]\n\n")
        yield FinalChunk(b"".join(out))
    except ClientGone:
        return
    finally:
        await stack.aclose()


async def stream_response(fe: Frontend, request: Request, parsed: Parsed, reply: Reply) -> Response:
    """A streamed request's response. Admission errors, and errors found before admission
    (tokenization, context length), are plain 4xx/5xx: the stream starts once the scheduler
    queued the request, not at its first token."""
    stack = contextlib.AsyncExitStack()  # closed by events(), or here if no stream starts
    job = await stack.enter_async_context(fe.job(parsed, request.receive))
    try:
        first = await next_item(job)
        if isinstance(first, Failure):
            fe.settle(job.states[first.index])
            fe.complete(job, "error")
            await stack.aclose()
            return error_response(reply.error(first.error))
    except ClientGone:
        await stack.aclose()
        return Response(status_code=499)
    except BaseException:
        await stack.aclose()
        raise
    return ClosingStreamingResponse(
        events(Stream(fe, job, parsed, reply), first, stack),
        on_close=stack.aclose,
        media_type="text/event-stream",
        # the replica is known here: the stream starts once the scheduler queued the request
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **fe.served_headers(job)},
    )
