"""Reasoning formats (a registry keyed by `--reasoning-parser` name) and their streaming split.

- `qwen3`: the think block is optional: the output is reasoning only when it starts (after
  whitespace) with `<think>`, or when the prompt opened the block (a template that ends the
  generation prompt with `<think>`; `enable_thinking=False` closes it there: no reasoning).
- `deepseek-r1`: the template opens the block, so the output starts inside the reasoning
  (unless the prompt closed it) and the reasoning ends at `</think>`; an output that writes the
  opening tag itself is accepted too.

The split, whole or streamed, is the same: the reasoning is the text up to the first
`</think>`, stripped; the content what follows, leading whitespace dropped (a block never
closed is all reasoning, its content empty). A stream holds back what may still turn out to be
a tag (and the reasoning's trailing whitespace) until the next delta tells, so no delta ever
carries half a tag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

START, END = "<think>", "</think>"


class Split(NamedTuple):
    """New text of each part (either may be empty)."""

    reasoning: str
    content: str


NOTHING = Split("", "")


@dataclass(frozen=True)
class ReasoningFormat:
    """How one model family writes its reasoning."""

    name: str
    starts_inside: bool  # the template opens the block (deepseek-r1): unless the prompt closed it

    def opens(self, prompt: str) -> bool:
        """Whether an output of the rendered `prompt` starts inside the reasoning."""
        tail = prompt.rstrip()
        if self.starts_inside:
            return not tail.endswith(END)
        return tail.endswith(START)

    def stream(self, inside: bool) -> ReasoningStream:
        """A parser for one output (`inside`: `opens(prompt)`)."""
        return ReasoningStream(inside)

    def split(self, text: str, inside: bool) -> tuple[str | None, str]:
        """A whole output as (reasoning, or None when it has none; content)."""
        s = self.stream(inside)
        a, b = s.feed(text), s.finish()
        return (a.reasoning + b.reasoning if s.entered else None), a.content + b.content


MAYBE, OPENING, INSIDE, CONTENT = range(4)  # ReasoningStream states


class ReasoningStream:
    """The split of one output as its text arrives: `feed` each delta, then `finish`.
    `entered`: whether the output has reasoning (a think block, however empty)."""

    __slots__ = ("buf", "entered", "lead", "state")

    def __init__(self, inside: bool) -> None:
        # OPENING: inside, an echoed `<think>` (after whitespace) still dropped
        self.state = OPENING if inside else MAYBE
        self.entered = inside
        self.buf = ""
        self.lead = True  # the current part's leading whitespace is dropped

    def feed(self, text: str) -> Split:
        if self.state == CONTENT and not self.lead:
            return Split("", text)
        self.buf += text
        return self._step(final=False)

    def finish(self) -> Split:
        return self._step(final=True)

    def _step(self, final: bool) -> Split:
        reasoning = ""
        if self.state in (MAYBE, OPENING):
            s = self.buf.lstrip()
            if s.startswith(START):
                self.buf = s[len(START) :]
            elif START.startswith(s) and not final:
                return NOTHING  # whitespace, or what may yet become `<think>`: wait
            elif self.state == MAYBE:  # no think block: the text is all content, as written
                self.state, self.lead = CONTENT, False
                out, self.buf = self.buf, ""
                return Split("", out)
            self.state, self.entered = INSIDE, True
        if self.state == INSIDE:
            if self.lead:
                self.buf = self.buf.lstrip()
                self.lead = not self.buf
            i = self.buf.find(END)
            if i >= 0:
                reasoning = self.buf[:i].rstrip()
                self.buf = self.buf[i + len(END) :]
                self.state, self.lead = CONTENT, True
            elif final:
                out, self.buf = self.buf.rstrip(), ""
                return Split(out, "")
            else:
                keep = _partial_tag(self.buf, END)
                k = len(self.buf[: len(self.buf) - keep].rstrip())
                out, self.buf = self.buf[:k], self.buf[k:]
                return Split(out, "")
        # CONTENT after the block: its leading whitespace dropped
        if self.lead:
            self.buf = self.buf.lstrip()
            self.lead = not self.buf
        out, self.buf = self.buf, ""
        return Split(reasoning, out)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that starts `tag` (a tag cut by the delta)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    f.name: f
    for f in (
        ReasoningFormat("qwen3", starts_inside=False),
        ReasoningFormat("deepseek-r1", starts_inside=True),
    )
}


def get_reasoning_format(name: str) -> ReasoningFormat:
    try:
        return REASONING_FORMATS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_FORMATS))
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}") from None
