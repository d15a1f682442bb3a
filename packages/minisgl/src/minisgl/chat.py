"""OpenAI chat `messages`, validated and made into what a chat template reads: one definition for
the server (`server/protocol.py` answers a `ChatError` with a 400 naming its field) and the
offline API (`LLM.generate` raises it: a ValueError), so both accept and render the same chats.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: rendered as system


class ChatError(ValueError):
    """Invalid messages; `param` is the field (`messages[1].role`), `code` the OpenAI code."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def parse_messages(msgs: Any) -> list[dict[str, Any]]:
    """`messages` as templates read them: `{"role", "content": str}` (developer as system, text
    parts joined), an assistant's `tool_calls` with their arguments parsed, a tool message's
    `tool_call_id` / `name`; a ChatError for anything else."""
    if not isinstance(msgs, list) or not msgs:
        raise ChatError(
            "'messages' must be a non-empty list",
            "messages",
            "invalid_type" if not isinstance(msgs, list) else "invalid_value",
        )
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping):
            raise ChatError(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise ChatError(
                f"messages[{i}].role must be {', '.join(ROLES[:-1])} or {ROLES[-1]}, got {role!r}",
                f"messages[{i}].role",
            )
        calls = _tool_calls(m.get("tool_calls"), i) if role == "assistant" else None
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for p in content:
                if not (
                    isinstance(p, Mapping)
                    and p.get("type") == "text"
                    and isinstance(p.get("text"), str)
                ):
                    raise ChatError(
                        f"messages[{i}].content: only text parts are supported",
                        f"messages[{i}].content",
                        "unsupported_parameter",
                    )
                parts.append(p["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise ChatError(
                f"messages[{i}].content must be a string or a list of text parts",
                f"messages[{i}].content",
                "invalid_type",
            )
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": content}  # fmt: skip
        if calls:
            msg["tool_calls"] = calls
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(m.get(key), str):
                    msg[key] = m[key]
        out.append(msg)
    return out


def _tool_calls(v: Any, i: int) -> list[dict] | None:
    """An assistant message's earlier `tool_calls`, arguments parsed (as templates read them)."""
    if v is None or v == []:
        return None
    where = f"messages[{i}].tool_calls"
    if not isinstance(v, list):
        raise ChatError(f"{where} must be a list", where, "invalid_type")
    out = []
    for call in v:
        fn = call.get("function") if isinstance(call, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        args = fn.get("arguments", "{}") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not isinstance(args, str | dict):
            raise ChatError(
                f"{where}: each call needs function.name and function.arguments (a JSON string)",
                where,
            )
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ChatError(f"{where}: function.arguments is not valid JSON", where) from None
        cid = call.get("id")
        out.append({"id": cid if isinstance(cid, str) else "", "type": "function",
                    "function": {"name": name, "arguments": args}})  # fmt: skip
    return out
