"""Tool-call formats (a registry keyed by name) and the grammar each builds from the tools.

- `hermes` (Qwen2.5 / Qwen3, NousResearch Hermes): `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`, one block a call. Also the fallback for a chat template that does not
  render tools (SmolLM2, the tiny test models): the tools then go in a system message.
- `llama3_json` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, calls separated by `; `.

The grammars are llguidance lark: the call bodies are `%json` of an anyOf over the offered
functions (`{"name": const, "<args key>": the function's parameters}`), so a call can only
name an offered function with arguments that validate. `required` / named: calls only; `auto`:
either free text (which cannot start a call) or text followed by calls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from minisgl.structured import ResponseFormat
from minisgl.tools.spec import Tool, ToolChoice


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes tool calls."""

    name: str
    args_key: str  # "arguments" | "parameters"
    open_tag: str  # before each call's JSON ("" for bare JSON)
    close_tag: str  # after it
    separator: str  # between two calls
    prefixes: tuple[str, ...]  # text that starts the calls in an output

    def call_schema(self, tools: Sequence[Tool]) -> dict:
        """The JSON schema of one call's body: an anyOf over `tools`, each function's `$defs`
        moved to the root (renamed per function) so its `$ref`s still resolve."""
        defs: dict[str, object] = {}
        bodies = []
        for i, t in enumerate(tools):
            params = _hoist_defs(json.loads(t.parameters), f"f{i}_", defs)
            bodies.append({
                "type": "object",
                "properties": {"name": {"const": t.name}, self.args_key: params},
                "required": ["name", self.args_key],
                "additionalProperties": False,
            })  # fmt: skip
        schema: dict = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
        if defs:
            schema["$defs"] = defs
        # fixed whitespace, with the separators of the templates' `tojson` (json.dumps's)
        schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": "}  # fmt: skip
        return schema

    def lark(self, tools: Sequence[Tool], choice: ToolChoice) -> str:
        """The lark grammar of an output under `choice` (not "none")."""
        body = json.dumps(self.call_schema(choice.offered(tools)))
        more = f" ({json.dumps(self.separator)} call)*" if choice.parallel else ""
        lines = [
            "call: "
            + " ".join(x for x in (_lit(self.open_tag), "body", _lit(self.close_tag)) if x),
            f"body: %json {body}",
        ]
        if choice.mode != "auto":
            return "\n".join([f"start: call{more}", *lines])
        if self.open_tag:  # free text, or text up to the first tag then calls
            tag = self.open_tag.rstrip()
            rest = self.open_tag[len(tag) :]
            lines += [
                f"start: TEXT | prefix {_lit(rest)} body {_lit(self.close_tag)}{more}",
                f"prefix[lazy]: /(?s:.*){_re(tag)}/",
                f"TEXT: /(?s:.+)/ & ~/(?s:.*{_re(tag)}.*)/",
            ]
        else:  # bare JSON: free text must not start like a call
            starts = "|".join(_re(p) for p in self.prefixes)
            lines += [
                f"start: TEXT | call{more}",
                f"TEXT: /(?s:.+)/ & ~/(?s:[ \\t\\n]*({starts}).*)/",
            ]
        return "\n".join(lines)

    def response_format(self, tools: Sequence[Tool], choice: ToolChoice) -> ResponseFormat | None:
        """The grammar `choice` constrains the output to; None for "none" (plain text)."""
        if choice.mode == "none" or not tools:
            return None
        return ResponseFormat.lark(self.lark(tools, choice))


def _hoist_defs(params: dict, prefix: str, defs: dict[str, object]) -> dict:
    """`params` without its `$defs` / `definitions` (added to `defs` as `prefix + name`), its
    local `$ref`s pointed at their new place."""
    local = {**params.pop("definitions", {}), **params.pop("$defs", {})}
    if not local:
        return params
    text = json.dumps(params)
    for key in ("$defs", "definitions"):
        for name in local:
            text = text.replace(f'"#/{key}/{name}"', f'"#/$defs/{prefix}{name}"')
    for name, sub in local.items():
        sub_text = json.dumps(sub)
        for key in ("$defs", "definitions"):
            for other in local:
                sub_text = sub_text.replace(f'"#/{key}/{other}"', f'"#/$defs/{prefix}{other}"')
        defs[prefix + name] = json.loads(sub_text)
    return json.loads(text)


def _lit(text: str) -> str:
    return json.dumps(text) if text else ""


def _re(text: str) -> str:
    """`text` as a literal inside a lark /regex/."""
    return "".join("\\" + c if c in REGEX_META else c for c in text)


REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        ToolFormat(
            "hermes", "arguments", "<tool_call>\n", "\n</tool_call>", "\n", ("<tool_call>",)
        ),
        ToolFormat("llama3_json", "parameters", "", "", "; ", ("<|python_tag|>", "{")),
    )
}
FALLBACK = "hermes"


def get_format(name: str) -> ToolFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; known: {sorted(FORMATS)}") from None


def detect_format(chat_template: str | None) -> ToolFormat:
    """The format a chat template teaches its model; `hermes` when it renders no tools."""
    t = chat_template or ""
    if "tools" in t and "<tool_call>" in t:
        return FORMATS["hermes"]
    if "tools" in t and ("<|python_tag|>" in t or "ipython" in t):
        return FORMATS["llama3_json"]
    return FORMATS[FALLBACK]


def renders_tools(chat_template: str | None) -> bool:
    """Whether the template itself puts the tools in the prompt."""
    return bool(chat_template) and "tools" in chat_template
