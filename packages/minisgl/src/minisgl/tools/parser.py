"""Tool calls out of generated text, whole or streamed: one `ToolCallParser` a choice.

`feed(text)` returns the events the new text completes: `ContentDelta` (plain text, never a
piece of a call's tag), `CallStart` (a call's index, id and name, once the name is complete)
and `ArgsDelta` (the next characters of its arguments' JSON, exactly as generated), so the
joined `ArgsDelta`s of a call are its `arguments` string. Whitespace around calls is dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from minisgl.tools.formats import ToolFormat


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgsDelta:
    index: int
    text: str


Event = ContentDelta | CallStart | ArgsDelta


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ParsedCalls:
    """A whole output: its text (None when it is only tool calls) and its calls."""

    content: str | None
    calls: tuple[ToolCall, ...]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class _Scan:
    """An incremental scan of one call's JSON object: where its top-level values are."""

    i: int = 0
    depth: int = 0
    in_str: bool = False
    esc: bool = False
    key_start: int = -1
    key: str | None = None
    value_start: int = -1
    expect_key: bool = True
    values: dict[str, tuple[int, int]] = field(default_factory=dict)
    open_value: tuple[str, int] | None = None  # a container value still open: (key, start)
    end: int | None = None  # one past the object's closing brace
    bad: bool = False

    def run(self, raw: str) -> None:
        while self.i < len(raw) and self.end is None and not self.bad:
            self._step(raw, self.i, raw[self.i])
            self.i += 1

    def _close_scalar(self, raw: str, i: int) -> None:
        if self.key is not None and self.value_start >= 0:
            self.values[self.key] = (self.value_start, len(raw[:i].rstrip()))
        self.key, self.value_start = None, -1

    def _step(self, raw: str, i: int, c: str) -> None:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                if self.depth == 1 and self.expect_key:
                    self.key = json.loads(raw[self.key_start : i + 1])
                    self.expect_key = False
                elif self.depth == 1 and self.key is not None:
                    self.values[self.key] = (self.value_start, i + 1)
                    self.key, self.value_start = None, -1
            return
        if self.depth == 0:
            if c == "{":
                self.depth = 1
            elif not c.isspace():
                self.bad = True
            return
        if self.depth == 1 and not c.isspace() and c not in ",}:":
            if self.expect_key and c != '"':
                self.bad = True
                return
            if not self.expect_key and self.key is not None and self.value_start < 0:
                self.value_start = i
        if c == '"':
            self.in_str = True
            if self.depth == 1 and self.expect_key:
                self.key_start = i
        elif c in "{[":
            if self.depth == 1 and self.key is not None:
                self.open_value = (self.key, i)
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1 and self.open_value is not None:
                key, start = self.open_value
                self.values[key] = (start, i + 1)
                self.open_value, self.key, self.value_start = None, None, -1
            elif self.depth == 0:
                self._close_scalar(raw, i)
                self.end = i + 1
        elif c == "," and self.depth == 1:
            self._close_scalar(raw, i)
            self.expect_key = True


class ToolCallParser:
    """Streams one choice's output into content and tool-call events (see the module doc)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.buf = ""  # text not yet turned into events
        self.mode = "start"  # start | text | call | after (a call just ended)
        self.calls: list[ToolCall] = []
        self.pending_ws = ""  # trailing whitespace held back: it may precede a call
        self.raw = ""  # the current call's JSON text
        self.scan = _Scan()
        self.started = False  # CallStart sent for the current call
        self.sent = 0  # argument characters sent for the current call
        self.call_id = ""
        self.name = ""

    # ------------------------------------------------------------------ events
    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while self._advance(out, final=False):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self._advance(out, final=True):
            pass
        if self.mode == "call":  # cut short (max_tokens): what came of the call stays
            if self.started:
                self._args(out)
            else:
                self._content(out, self.fmt.open_tag + self.raw)
        elif self.buf.strip() or (self.buf and not self.calls):
            self._content(out, self.buf)
        if self.pending_ws and not self.calls:
            out.append(ContentDelta(self.pending_ws))
        self.buf = self.pending_ws = ""
        return out

    def _content(self, out: list[Event], text: str) -> None:
        """Emit text after the held whitespace, holding back its own trailing whitespace."""
        text = self.pending_ws + text
        body = text.rstrip()
        self.pending_ws = text[len(body) :]
        if body:
            out.append(ContentDelta(body))

    # ------------------------------------------------------------------ state machine
    def _advance(self, out: list[Event], final: bool) -> bool:
        """One step; True while the buffer may allow another."""
        if self.mode == "start":
            return self._start(final)
        if self.mode == "after":
            return self._after(final)
        if self.mode == "text":
            return self._text(out)
        return self._call(out)

    def _start(self, final: bool) -> bool:
        if self.fmt.open_tag:
            self.mode = "text"
            return True
        s = self.buf.lstrip()  # bare JSON: calls only at the start of the output
        if not s:
            return False
        if not final and any(p.startswith(s) and p != s for p in self.fmt.prefixes):
            return False
        if not self._open_bare(s):
            self.mode = "text"
        return True

    def _after(self, final: bool) -> bool:
        s = self.buf.lstrip()
        if not s:
            return False
        tag = self.fmt.close_tag.strip()
        if tag:
            if s.startswith(tag):
                self.buf = s[len(tag) :]
                self.mode = "text"
                return True
            if tag.startswith(s) and not final:
                return False
            self.mode = "text"
            return True
        sep = self.fmt.separator.strip()
        if sep and s.startswith(sep):
            rest = s[len(sep) :].lstrip()
            if not rest:
                return False
            if self._open_bare(rest):
                return True
        self.mode = "text"
        return True

    def _open_bare(self, s: str) -> bool:
        for p in self.fmt.prefixes:
            if s.startswith(p):
                self._begin_call(s if p == "{" else s[len(p) :])
                return True
        return False

    def _text(self, out: list[Event]) -> bool:
        tag = self.fmt.open_tag.rstrip()
        if not tag:  # bare JSON formats: after the start, text is text
            if self.buf:
                self._content(out, self.buf)
                self.buf = ""
            return False
        pos = self.buf.find(tag)
        if pos >= 0:
            self._content(out, self.buf[:pos])
            rest = self.buf[pos + len(tag) :]
            nl = self.fmt.open_tag[len(tag) :]
            self._begin_call(rest[len(nl) :] if nl and rest.startswith(nl) else rest)
            return True
        hold = next(
            (k for k in range(min(len(tag) - 1, len(self.buf)), 0, -1)
             if tag.startswith(self.buf[-k:])),
            0,
        )  # fmt: skip
        self._content(out, self.buf[: len(self.buf) - hold])
        self.buf = self.buf[len(self.buf) - hold :]
        return False

    def _begin_call(self, rest: str) -> None:
        self.mode = "call"
        self.raw = ""
        self.scan = _Scan()
        self.started = False
        self.sent = 0
        self.call_id = new_call_id()
        self.name = ""
        self.pending_ws = ""  # whitespace before a call is dropped
        self.buf = rest

    def _call(self, out: list[Event]) -> bool:
        self.raw += self.buf
        self.buf = ""
        self.scan.run(self.raw)
        sc = self.scan
        if sc.bad and not self.started:  # not a call after all: its text is content
            self.mode = "text"
            self._content(out, self.fmt.open_tag.rstrip() + self.raw)
            self.raw = ""
            return False
        name = sc.values.get("name")
        if not self.started and name is not None:
            try:
                value = json.loads(self.raw[name[0] : name[1]])
            except ValueError:
                value = None
            if isinstance(value, str):
                self.name = value
                self.started = True
                out.append(CallStart(len(self.calls), self.call_id, value))
        if self.started:
            self._args(out)
        if sc.end is None:
            return False
        if not self.started:  # a complete object without a name: content
            self.mode = "text"
            self._content(out, self.fmt.open_tag.rstrip() + self.raw[: sc.end])
            self.buf = self.raw[sc.end :]
            self.raw = ""
            return True
        self.calls.append(ToolCall(self.call_id, self.name, self._args_text(complete=True)))
        self.buf = self.raw[sc.end :]
        self.raw = ""
        self.mode = "after"
        return True

    def _args_span(self) -> tuple[int, int] | None:
        sc = self.scan
        for key in (self.fmt.args_key, "arguments", "parameters"):
            if key in sc.values:
                return sc.values[key]
            if sc.open_value is not None and sc.open_value[0] == key:
                return sc.open_value[1], len(self.raw)
        return None

    def _args_text(self, complete: bool) -> str:
        span = self._args_span()
        if span is None:
            return "{}" if complete else ""
        return self.raw[span[0] : span[1]]

    def _args(self, out: list[Event]) -> None:
        text = self._args_text(complete=self.scan.end is not None)
        if len(text) > self.sent:
            out.append(ArgsDelta(len(self.calls), text[self.sent :]))
            self.sent = len(text)


def parse_tool_calls(fmt: ToolFormat, text: str) -> ParsedCalls:
    """A whole output through the same parser as a stream (so both agree)."""
    parser = ToolCallParser(fmt)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[list[str]] = []
    for e in events:
        if isinstance(e, CallStart):
            calls.append([e.id, e.name, ""])
        elif isinstance(e, ArgsDelta):
            calls[e.index][2] += e.text
    out = tuple(ToolCall(i, n, a) for i, n, a in calls)
    if out and not content.strip():
        return ParsedCalls(None, out)
    return ParsedCalls(content if content or not out else None, out)
