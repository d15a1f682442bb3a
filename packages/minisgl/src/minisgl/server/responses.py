"""Response building shared by both kinds of request (`Reply`, usage, logprobs, errors), and
the non-streamed response: every choice's whole text, then one JSON body (tool calls and
reasoning split out of it). The streamed one is `sse.py`'s."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minisgl.server.chat_prompt import Think
from minisgl.server.frontend import ClientGone, Frontend, Job, next_item
from minisgl.server.mailbox import Accepted, Failure
from minisgl.server.protocol import APIError, Parsed
from minisgl.tools import ToolFormat, parse_tool_calls


def error_response(e: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    """`headers`: added to the error's own (the replica of a request that failed on one)."""
    merged = {**(e.headers or {}), **(headers or {})} or None
    return JSONResponse(e.body(), status_code=e.status, headers=merged)


def usage(job: Job) -> dict:
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.completion_tokens,
        "total_tokens": job.prompt_tokens + job.completion_tokens,
    }


def chat_logprobs(entries: list) -> dict:
    def one(tok: str, lp: float) -> dict:
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8", "replace"))}

    return {"content": [{**one(t, lp), "top_logprobs": [one(*x) for x in top]}
                        for t, lp, top in entries]}  # fmt: skip


def completion_logprobs(entries: list, offset: int) -> dict:
    """OpenAI's legacy shape; `offset`: characters of this choice's text before these tokens."""
    offsets = []
    for t, _, _ in entries:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": [t for t, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [dict(top) for _, _, top in entries],
        "text_offset": offsets,
    }


@dataclass(frozen=True)
class Reply:
    """What every response of one request shares (`tools`: the format its tool calls are
    parsed in; None when the request has no tools or tool_choice is "none")."""

    chat: bool
    id: str
    created: int
    model: str
    tools: ToolFormat | None = None
    think: Think | None = None  # --reasoning-parser: how the outputs split

    def error(self, e: APIError) -> APIError:
        """The engine names the prompt 'prompt'; on the chat endpoint it is 'messages'."""
        if self.chat and e.param == "prompt":
            return APIError(e.status, e.message, "messages", e.code, e.headers)
        return e

    def envelope(self, choices: list, obj: str) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


# ----------------------------------------------------------------------------- non-streamed
@dataclass
class Whole:
    """A non-streamed request's outputs per choice: its text's parts, its logprobs (None when
    not asked for) and its finish reason."""

    texts: list[list[str]]
    logprobs: list[list | None]
    finish: list[str | None]

    @classmethod
    def of(cls, n: int, want_logprobs: bool) -> Whole:
        return cls([[] for _ in range(n)], [[] if want_logprobs else None for _ in range(n)],
                   [None] * n)  # fmt: skip


async def collect(fe: Frontend, job: Job, out: Whole) -> Failure | None:
    """Every choice's outputs into `out` until each finished; the first failure ends the
    request (returned). Raises ClientGone."""
    left = len(job.states)
    while left:
        item = await next_item(job)
        if isinstance(item, Accepted):
            continue
        st = job.states[item.index]
        if isinstance(item, Failure):
            fe.settle(st)
            fe.complete(job, "error")
            return item
        out.texts[item.index].append(item.text)
        lps = out.logprobs[item.index]
        if item.logprobs and lps is not None:
            lps.extend(item.logprobs)
        if item.finish is not None:
            out.finish[item.index] = item.finish
            fe.settle(st)
            left -= 1
    return None


async def complete_response(
    fe: Frontend, request: Request, parsed: Parsed, reply: Reply
) -> Response | dict:
    async with fe.job(parsed, request.receive) as job:
        out = Whole.of(len(job.states), parsed.params.logprobs is not None)
        try:
            failed = await collect(fe, job, out)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the job context aborts
        if failed is not None:
            return error_response(reply.error(failed.error), fe.served_headers(job))
        fe.complete(job, "ok")
    choices = [
        whole_choice(reply, i, "".join(parts), out.logprobs[i], out.finish[i])
        for i, parts in enumerate(out.texts)
    ]
    body = reply.envelope(choices, "chat.completion" if reply.chat else "text_completion")
    body["usage"] = usage(job)
    served = fe.served(job)
    if served is None:
        return body
    body["minisgl"] = served
    return JSONResponse(body, headers=fe.served_headers(job))


def whole_choice(reply: Reply, i: int, content: str, lp: list | None, finish: str | None) -> dict:
    """One choice of a non-streamed response: chat's message (reasoning and tool calls split
    out), or a completion's text."""
    if not reply.chat:
        lps = None if lp is None else completion_logprobs(lp, 0)
        return {"index": i, "text": content, "logprobs": lps, "finish_reason": finish}
    reasoning = None
    if reply.think is not None:
        reasoning, content = reply.think.split(content)
    msg, fin = assistant_message(reply.tools, content, finish)
    if reply.think is not None:
        msg["reasoning_content"] = reasoning
    lps = None if lp is None else chat_logprobs(lp)
    return {"index": i, "message": msg, "logprobs": lps, "finish_reason": fin}


def assistant_message(
    fmt: ToolFormat | None, content: str, finish: str | None
) -> tuple[dict, str | None]:
    """The chat message of a whole answer and its finish reason (tool calls parsed out)."""
    calls = parse_tool_calls(fmt, content) if fmt is not None else None
    if calls is None or not calls.calls:
        return {"role": "assistant", "content": content}, finish
    msg = {
        "role": "assistant",
        "content": calls.content,
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls.calls
        ],
    }
    return msg, "tool_calls" if finish == "stop" else finish
