"""Chats the API server renders itself (so every control plane gets the same token ids): those
with tools, with `chat_template_kwargs`, or under `--reasoning-parser` (whose split needs the
rendered prompt: did it open a `<think>` block?). The constrained output of such a chat, the
tools' grammar or the client's `response_format`, gets its free think block first
(`reasoning.with_reasoning`); what travels on is token ids and that grammar."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from minisgl.reasoning import ReasoningFormat, ReasoningStream
from minisgl.reasoning.formats import END, START
from minisgl.server.protocol import APIError, Parsed
from minisgl.structured import ResponseFormat
from minisgl.tools import ToolFormat
from minisgl.tools.render import ChatRenderer


@dataclass(frozen=True)
class Think:
    """How a request's outputs split: the server's reasoning format, and whether the prompt
    opened the block (the output starts inside the reasoning)."""

    fmt: ReasoningFormat
    inside: bool

    def split(self, text: str) -> tuple[str | None, str]:
        return self.fmt.split(text, self.inside)

    def stream(self) -> ReasoningStream:
        return self.fmt.stream(self.inside)


def renders_here(parsed: Parsed, reasoning: ReasoningFormat | None) -> bool:
    """Whether the chat is rendered by the API server (else by the tokenizer worker)."""
    return parsed.tools is not None or parsed.template_kwargs is not None or reasoning is not None


def render_chat(
    renderer: ChatRenderer, parsed: Parsed, reasoning: ReasoningFormat | None
) -> tuple[Parsed, ToolFormat | None, Think | None]:
    """The chat as token ids under its grammar, the format its tool calls are parsed in (None:
    no tools, or tool_choice "none") and its reasoning split (None: no parser). Runs off the
    event loop (the tokenizer loads on first use)."""
    use = parsed.tools
    try:
        fmt = renderer.tool_format() if use is not None else None
        text, ids = renderer.render(parsed.prompt, None if use is None else use.tools,
                                    parsed.template_kwargs)  # fmt: skip
    except Exception as e:  # a template that fails on these messages (or these kwargs)
        what = "with its tools" if use is not None else "with its chat_template_kwargs"
        raise APIError(400, f"cannot render the chat {what}: {e}", "messages") from None
    grammar = None
    if use is not None and fmt is not None:
        try:
            grammar = fmt.response_format(use.tools, use.choice)
        except ValueError as e:
            raise APIError(400, f"the tools give no valid grammar: {e}", "tools") from None
        if grammar is None:
            fmt = None  # tool_choice "none": plain text, no calls parsed
    params = parsed.params
    think = None
    if reasoning is not None:
        think = Think(reasoning, reasoning.opens(text))
        if grammar is None and params.response_format is not None:
            grammar = ResponseFormat.parse(json.loads(params.response_format))
        if grammar is not None:
            from minisgl.reasoning import with_reasoning

            tags = renderer.single_tokens((START, END))
            grammar = with_reasoning(grammar, reasoning, think.inside, tags)
    if grammar is not None:
        params = dataclasses.replace(params, response_format=json.dumps(grammar.to_json()))
    return dataclasses.replace(parsed, kind="ids", prompt=ids, params=params), fmt, think
