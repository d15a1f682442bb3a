"""Constrained output after the reasoning: a `response_format` (JSON schema / object, regex,
choice) or a tool-call grammar made into one llguidance lark grammar whose answer follows a
free `<think>` block: required when the prompt opened the block (the output starts inside
it), optional otherwise. The block's text holds no `</think>` (the parser splits at the first);
whitespace may follow the block before the answer. A tag the tokenizer holds as one added
token (Qwen3's, DeepSeek-R1's) is matched as that token (llguidance treats added tokens as
special: never as their text) or as its text written in pieces."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from minisgl.reasoning.formats import END, START, ReasoningFormat
from minisgl.structured import ResponseFormat

# the block's text up to the first `</think>` written as text (lazy: it ends there)
CLOSED = "closed[lazy]: /(?s:.*)<\\/think>/"
TXT = "TXT: /(?s:.*)/ & ~/(?s:.*<\\/think>.*)/"  # text before a `</think>` token
GAP = "GAP: /[ \\t\\n]+/"


def tag_tokens(tokenizer: Any) -> dict[str, int]:
    """The think tags an HF tokenizer holds as single tokens: {tag: token id}."""
    out = {}
    for tag in (START, END):
        ids = tokenizer(tag, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == tag:
            out[tag] = int(ids[0])
    return out


def with_reasoning(
    fmt: ResponseFormat,
    reasoning: ReasoningFormat,
    inside: bool,
    tags: Mapping[str, int] | None = None,
) -> ResponseFormat:
    """`fmt` (any kind) as a lark grammar that lets a think block come first. `reasoning`:
    the server's format (every registered one writes `<think>` blocks); `inside`:
    `reasoning.opens(prompt)`; `tags`: `tag_tokens(tokenizer)`."""
    del reasoning
    tags = tags or {}
    start = "start: think GAP? answer" if inside else "start: (open think GAP?)? answer"
    opening = f"<[{tags[START]}]> | {json.dumps(START)}" if START in tags else json.dumps(START)
    think = f"think: TXT? <[{tags[END]}]> | closed" if END in tags else "think: closed"
    rules = [start, f"open: {opening}", think, CLOSED, GAP, *([TXT] if END in tags else [])]
    return ResponseFormat.lark("\n".join([*rules, *_answer(fmt)]))


def _answer(fmt: ResponseFormat) -> list[str]:
    """The rules of `answer`: what `fmt` constrains the whole output to."""
    if fmt.kind == "grammar":  # a lark grammar of ours (tools): its start renamed
        return [re.sub(r"(?m)^start(\s*):", r"answer\1:", fmt.schema)]
    if fmt.kind == "regex":
        return [f"answer: /{_slash(fmt.schema)}/"]
    if fmt.kind == "choice":  # lark string literals are JSON strings
        return ["answer: " + " | ".join(json.dumps(c) for c in json.loads(fmt.schema))]
    schema = json.loads(fmt.schema)
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    # the whitespace of `ResponseFormat.grammar`'s JSON (fixed), unless the schema says
    schema["x-guidance"] = {"whitespace_flexible": False, **schema.get("x-guidance", {})}
    return [f"answer: %json {json.dumps(schema)}"]


def _slash(pattern: str) -> str:
    """`pattern` inside lark's /.../: every unescaped `/` escaped."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(pattern[i : i + 2])
            i += 2
            continue
        out.append("\\/" if c == "/" else c)
        i += 1
    return "".join(out)
