"""OpenAI `tools` / `tool_choice` / `parallel_tool_calls`, validated (a `ToolError` names the
request field it is about)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS = '{"properties": {}, "type": "object"}'


class ToolError(ValueError):
    """An invalid tool request; `param` is the request field (`tools`, `tool_choice`, ...)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    """One function the model may call; `parameters` is its JSON schema's text (properties in
    the order given: the arguments come out in that order)."""

    name: str
    description: str | None
    parameters: str

    def to_openai(self) -> dict[str, Any]:
        """The definition as chat templates read it (`{"type": "function", "function": ...}`)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """`mode` "named" forces one call of the function `name`; `parallel`: more than one call
    allowed (never for "named")."""

    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None
    parallel: bool = True

    def offered(self, tools: Sequence[Tool]) -> tuple[Tool, ...]:
        """The tools a call may name under this choice."""
        if self.mode == "named":
            return tuple(t for t in tools if t.name == self.name)
        return tuple(tools) if self.mode != "none" else ()


def parse_tools(raw: Any) -> tuple[Tool, ...]:
    """`tools` as OpenAI defines it; None or [] is no tools."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ToolError("'tools' must be a list of function tools", "tools")
    out: list[Tool] = []
    for i, item in enumerate(raw):
        out.append(_tool(item, f"tools[{i}]"))
    names = [t.name for t in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ToolError(f"tools: the function name {dup!r} is defined twice", "tools")
    return tuple(out)


def _tool(item: Any, where: str) -> Tool:
    if not isinstance(item, Mapping) or item.get("type") != "function":
        raise ToolError(f"{where}: only {{'type': 'function', 'function': ...}} tools", "tools")
    fn = item.get("function")
    if not isinstance(fn, Mapping):
        raise ToolError(f"{where}.function must be an object", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ToolError(
            f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'; got {name!r}",
            "tools",
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.function.description must be a string", "tools")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{where}.function.strict must be a boolean", "tools")
    params = fn.get("parameters")
    if params is None:
        return Tool(name, description, EMPTY_PARAMETERS)
    if not isinstance(params, Mapping) or params.get("type", "object") != "object":
        raise ToolError(
            f"{where}.function.parameters must be a JSON schema of type 'object'", "tools"
        )
    text = json.dumps(params)
    from minisgl.structured import ResponseFormat

    try:
        ResponseFormat("json_schema", text).check()
    except ValueError as exc:
        reason = str(exc).split(": ", 1)[-1]
        raise ToolError(f"{where}.function.parameters: invalid schema: {reason}", "tools") from None
    return Tool(name, description, text)


def parse_tool_choice(raw: Any, tools: Sequence[Tool], parallel: Any = None) -> ToolChoice:
    """`tool_choice` (default: "auto" with tools, "none" without) and `parallel_tool_calls`."""
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    par = parallel is not False
    if raw is None:
        return ToolChoice("auto" if tools else "none", None, par)
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise ToolError(
                f"'tool_choice' must be none, auto, required or a named function; got {raw!r}",
                "tool_choice",
            )
        if raw != "none" and not tools:
            raise ToolError(f"tool_choice {raw!r} needs 'tools'", "tool_choice")
        return ToolChoice(raw, None, par)  # type: ignore[arg-type]
    fn = raw.get("function") if isinstance(raw, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(raw, Mapping) or raw.get("type") != "function" or not isinstance(name, str):
        raise ToolError(
            "'tool_choice' must be a string or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if not tools:
        raise ToolError("a named 'tool_choice' needs 'tools'", "tool_choice")
    if name not in {t.name for t in tools}:
        raise ToolError(f"tool_choice names {name!r}, which is not in 'tools'", "tool_choice")
    # one call of the function, as OpenAI and vLLM answer a named choice: a grammar that let it
    # repeat gave the same call two or three times (parallel_tool_calls is no reason to)
    return ToolChoice("named", name, False)


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and choice; the API server renders its prompt (`render`)."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
