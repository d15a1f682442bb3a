"""Chat prompts with tools, rendered in the API server (so both control planes see the same
token ids): through the chat template when it renders `tools`, else with the Hermes fallback
(the tools in a system message, earlier calls as `<tool_call>` blocks, results as
`<tool_response>` blocks), which is what `detect_format` then parses."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from minisgl.tools.formats import ToolFormat, detect_format, renders_tools
from minisgl.tools.spec import Tool

FALLBACK_SYSTEM = """You may call functions. Their signatures:
<tools>
{tools}
</tools>
For each call, answer a JSON object with the function's name and arguments within \
<tool_call></tool_call> tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def fallback_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]) -> list[dict]:
    """The chat for a template that knows no tools: plain role / content messages only."""
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                              "arguments": c["function"]["arguments"]})
                + "\n</tool_call>"
                for c in m["tool_calls"]
            ]  # fmt: skip
            content = "\n".join([content, *blocks] if content else blocks)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        listed = "\n".join(json.dumps(t.to_openai()["function"], separators=(",", ":"))
                           for t in tools)  # fmt: skip
        system = FALLBACK_SYSTEM.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


class ChatRenderer:
    """The model's tokenizer in the API server (loaded on first use; thread-safe)."""

    def __init__(self, model_path: str, chat_template: str | None = None) -> None:
        self.model_path = model_path
        self.chat_template = chat_template  # --chat-template (None: the model's)
        self._tok: Any = None
        self._lock = threading.Lock()

    def _tokenizer(self) -> Any:
        if self._tok is None:
            from minisgl.tokenizer.load import load_tokenizer

            self._tok = load_tokenizer(self.model_path, self.chat_template)
        return self._tok

    @property
    def template(self) -> str | None:
        with self._lock:
            t = getattr(self._tokenizer(), "chat_template", None)
        return t if isinstance(t, str) else None

    def tool_format(self) -> ToolFormat:
        return detect_format(self.template)

    def render_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]) -> list[int]:
        """The prompt's token ids, as the tokenizer worker makes them for a chat."""
        return self.render(messages, tools)[1]

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Tool] | None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The prompt's text and token ids; `tools` None: a chat without tools, rendered as the
        tokenizer worker renders it; `template_kwargs`: the request's `chat_template_kwargs`."""
        kw = dict(template_kwargs or {})
        with self._lock:
            tok = self._tokenizer()
            template = getattr(tok, "chat_template", None)
            if tools is None:
                text = tok.apply_chat_template(
                    list(messages), add_generation_prompt=True, tokenize=False, **kw
                )
            elif renders_tools(template if isinstance(template, str) else None):
                text = tok.apply_chat_template(
                    list(messages), tools=[t.to_openai() for t in tools] or None,
                    add_generation_prompt=True, tokenize=False, **kw,
                )  # fmt: skip
            else:
                text = tok.apply_chat_template(
                    fallback_messages(messages, tools), add_generation_prompt=True,
                    tokenize=False, **kw,
                )  # fmt: skip
            return text, list(tok(text, add_special_tokens=False)["input_ids"])

    def single_tokens(self, texts: Sequence[str]) -> dict[str, int]:
        """The `texts` the tokenizer holds as one token each: {text: token id}."""
        out = {}
        with self._lock:
            tok = self._tokenizer()
            for text in texts:
                ids = tok(text, add_special_tokens=False)["input_ids"]
                if len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == text:
                    out[text] = int(ids[0])
        return out
