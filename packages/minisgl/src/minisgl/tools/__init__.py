"""Tool calling (issue 38): OpenAI `tools` / `tool_choice`, the tool-call formats of the
supported families with a grammar each (`formats`), their streaming parser (`parser`) and the
chat prompt with tools (`render`)."""

from minisgl.tools.formats import FORMATS, ToolFormat, detect_format, get_format
from minisgl.tools.parser import (
    ArgsDelta,
    CallStart,
    ContentDelta,
    Event,
    ParsedCalls,
    ToolCall,
    ToolCallParser,
    parse_tool_calls,
)
from minisgl.tools.spec import Tool, ToolChoice, ToolError, ToolUse, parse_tool_choice, parse_tools

__all__ = [
    "FORMATS",
    "ArgsDelta",
    "CallStart",
    "ContentDelta",
    "Event",
    "ParsedCalls",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolChoice",
    "ToolError",
    "ToolFormat",
    "ToolUse",
    "detect_format",
    "get_format",
    "parse_tool_calls",
    "parse_tool_choice",
    "parse_tools",
]
