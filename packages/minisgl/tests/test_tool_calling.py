"""Issue 38, tool calling, offline: the tool-call parsers (Qwen / Hermes `<tool_call>` JSON,
Llama 3.x JSON), whole and streamed in any split; the grammars built from the tools keep every
call valid on a tiny random llama; fifty varied JSON schemas all constrain and validate."""

from __future__ import annotations

import json
from typing import Any

import pytest

from minisgl import SamplingParams
from minisgl.testing.modules import require_module
from minisgl.testing.schemas import PARAMS, SCHEMAS, TOOLS

CARD = "P3-002"
RED = "tool-calling-tests-fail-before-the-tools-exist"
GREEN = "tool-calling-tests-pass"


HERMES_TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "add", "arguments": {"a": 1, "b": {"nested": "}\\""}}}\n</tool_call>'
)
LLAMA_TEXT = '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}'


def tools_api():
    return require_module("minisgl.tools")


def whole(fmt_name: str, text: str) -> Any:
    tools = tools_api()
    return tools.parse_tool_calls(tools.FORMATS[fmt_name], text)


def streamed(fmt_name: str, text: str, step: int) -> tuple[str, list[dict]]:
    """Feed `text` in pieces of `step` characters; the events joined as a client joins them."""
    tools = tools_api()
    parser = tools.ToolCallParser(tools.FORMATS[fmt_name])
    content, calls = "", []
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i : i + step])
    events += parser.finish()
    for ev in events:
        if isinstance(ev, tools.ContentDelta):
            content += ev.text
        elif isinstance(ev, tools.CallStart):
            assert ev.index == len(calls) and ev.id.startswith("call_"), ev
            calls.append({"name": ev.name, "arguments": ""})
        elif isinstance(ev, tools.ArgsDelta):
            calls[ev.index]["arguments"] += ev.text
    return content, calls


PARSE = "a-parser-per-tool-call-format-chosen-by-the-chat-template"


@pytest.mark.card(CARD, PARSE, RED, GREEN)
def test_hermes_calls_parse_whole_and_in_any_split():
    out = whole("hermes", HERMES_TEXT)
    assert out.content == "Let me check."
    assert [c.name for c in out.calls] == ["get_weather", "add"]
    assert json.loads(out.calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    assert json.loads(out.calls[1].arguments) == {"a": 1, "b": {"nested": '}"'}}
    assert all(c.id.startswith("call_") for c in out.calls)
    for step in (1, 2, 3, 5, 7, 64):
        content, calls = streamed("hermes", HERMES_TEXT, step)
        assert content.strip() == "Let me check.", (step, content)
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.name, c.arguments) for c in out.calls
        ], step


@pytest.mark.card(CARD, PARSE, RED, GREEN)
@pytest.mark.parametrize(
    "text",
    [
        LLAMA_TEXT,
        "<|python_tag|>" + LLAMA_TEXT,
        LLAMA_TEXT + "; " + LLAMA_TEXT.replace("Rome", "Oslo"),
    ],
    ids=["plain", "python-tag", "two"],
)
def test_llama3_json_calls_parse_whole_and_in_any_split(text):
    out = whole("llama3_json", text)
    assert out.content is None
    assert [c.name for c in out.calls] == ["get_weather"] * (2 if "; " in text else 1)
    assert json.loads(out.calls[0].arguments) == {"city": "Rome", "unit": "celsius"}
    for step in (1, 4, 9):
        content, calls = streamed("llama3_json", text, step)
        assert content == ""
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.name, c.arguments) for c in out.calls
        ]


@pytest.mark.card(CARD, PARSE, RED, GREEN)
@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_plain_text_stays_content(fmt):
    text = "No tools needed: 2 < 3 and {braces} later."
    out = whole(fmt, text)
    assert out.content == text and out.calls == ()
    for step in (1, 3):
        assert streamed(fmt, text, step) == (text, [])


@pytest.mark.card(CARD, PARSE, RED, GREEN)
def test_the_format_follows_the_chat_template():
    from minisgl.testing.tiny_models import CHAT_TEMPLATE

    tools = tools_api()
    qwen = "{%- if tools %}<tools>{{ tools }}</tools> ... <tool_call> ... </tool_call>{% endif %}"
    llama = "{%- if tools %}... <|python_tag|> ... ipython {% endif %}"
    assert tools.detect_format(qwen).name == "hermes"
    assert tools.detect_format(llama).name == "llama3_json"
    assert tools.detect_format(CHAT_TEMPLATE).name == "hermes"  # no tools in it: the fallback
    assert tools.detect_format(None).name == "hermes"
    assert set(tools.FORMATS) >= {"hermes", "llama3_json"}


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    from minisgl import LLM

    return LLM(tiny_model_dir("llama"), num_pages=4096, max_seq_len_override=512)


def _tool_format(fmt_name: str, choice: Any):
    tools = tools_api()
    specs = tools.parse_tools(TOOLS)
    return tools.FORMATS[fmt_name].response_format(specs, tools.parse_tool_choice(choice, specs))


def _check_calls(calls, names: set[str], finish: str = "stop") -> None:
    """The calls name offered functions with valid arguments; one cut by max_tokens (the
    last, `finish` "length": parallel calls may go on) is not judged."""
    jsonschema = require_module("jsonschema")
    assert calls, "no tool call"
    if finish == "length" and len(calls) > 1:
        calls = calls[:-1]
    for call in calls:
        assert call.name in names, call
        jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])


@pytest.mark.card(
    CARD, "constrained-tool-calls-validate-against-their-parameter-schemas", RED, GREEN
)
@pytest.mark.parametrize("fmt_name", ["hermes", "llama3_json"])
def test_required_named_and_auto_calls_validate(tiny_llm, fmt_name):
    tools = tools_api()
    choices = ["required", {"type": "function", "function": {"name": "add"}}, "auto"]
    prompts, sps, kinds = [], [], []
    for choice in choices:
        for seed in range(4):
            prompts.append([{"role": "user", "content": f"Weather in Paris or 2 + {seed}?"}])
            sps.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=160,
                                      response_format=_tool_format(fmt_name, choice)))  # fmt: skip
            kinds.append(choice)
    outs = tiny_llm.generate(prompts, sps)
    fmt = tools.FORMATS[fmt_name]
    for choice, out in zip(kinds, outs, strict=True):
        parsed = tools.parse_tool_calls(fmt, out["text"])
        finish = out["finish_reason"]
        if choice == "required":
            _check_calls(parsed.calls, set(PARAMS), finish)
        elif choice != "auto":
            _check_calls(parsed.calls, {"add"}, finish)
        elif parsed.calls:  # auto: free text, or calls that validate
            _check_calls(parsed.calls, set(PARAMS), finish)


@pytest.mark.card(
    CARD, "constrained-tool-calls-validate-against-their-parameter-schemas", RED, GREEN
)
def test_tool_choice_none_and_no_tools_need_no_grammar():
    tools = tools_api()
    specs = tools.parse_tools(TOOLS)
    assert (
        tools.FORMATS["hermes"].response_format(specs, tools.parse_tool_choice("none", specs))
        is None
    )
    assert tools.parse_tool_choice(None, specs).mode == "auto"
    assert tools.parse_tool_choice(None, ()).mode == "none"


def test_a_named_tool_choice_is_one_call_whatever_parallel_tool_calls_says():
    """Issue 60: a named choice's grammar allowed the call repeated (`call ("\\n" call)*`)."""
    tools = tools_api()
    specs = tools.parse_tools(TOOLS)
    named = {"type": "function", "function": {"name": "add"}}
    for parallel in (None, True, False):
        choice = tools.parse_tool_choice(named, specs, parallel)
        assert (choice.mode, choice.name, choice.parallel) == ("named", "add", False)
        assert ")*" not in tools.FORMATS["hermes"].lark(specs, choice)
    assert tools.parse_tool_choice("required", specs).parallel  # the others keep the default


@pytest.mark.card(CARD, "fifty-varied-json-schemas-constrain-and-validate", RED, GREEN)
def test_fifty_schemas_validate_in_one_batch(tiny_llm):
    """One `generate` call: every completion of the 50 schemas (sampled, tiny random llama)
    finishes and validates."""
    jsonschema = require_module("jsonschema")
    assert len(SCHEMAS) == 50
    prompts = [[{"role": "user", "content": f"Answer {i} in JSON."}] for i in range(len(SCHEMAS))]
    sps = [
        SamplingParams(temperature=0.9, seed=i, max_tokens=160, response_format={
            "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s, "strict": True}})
        for i, s in enumerate(SCHEMAS)
    ]  # fmt: skip
    outs = tiny_llm.generate(prompts, sps)
    bad = []
    for i, (schema, out) in enumerate(zip(SCHEMAS, outs, strict=True)):
        try:
            assert out["finish_reason"] == "stop", "did not finish"
            jsonschema.validate(json.loads(out["text"]), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            bad.append((i, out["text"][:80], str(exc)[:120]))
    assert not bad, bad


@pytest.mark.card(CARD, "fifty-varied-json-schemas-constrain-and-validate", RED, GREEN)
def test_fifty_schemas_as_tool_parameters_validate(tiny_llm):
    """The same schemas as the one parameter `value` of a function, `tool_choice: required`
    (Hermes format): every call names the function and its arguments validate."""
    jsonschema = require_module("jsonschema")
    tools = tools_api()
    fmt = tools.FORMATS["hermes"]
    prompts, sps, wanted = [], [], []
    for i, schema in enumerate(SCHEMAS):
        inner = {k: v for k, v in schema.items() if k != "$defs"}  # $defs stay at the root
        params = {"type": "object", "properties": {"value": inner}, "required": ["value"],
                  "additionalProperties": False, **({"$defs": schema["$defs"]}
                                                    if "$defs" in schema else {})}  # fmt: skip
        specs = tools.parse_tools([{"type": "function",
                                    "function": {"name": f"f{i}", "parameters": params}}])  # fmt: skip
        choice = tools.parse_tool_choice("required", specs, parallel=False)
        prompts.append([{"role": "user", "content": f"Call f{i}."}])
        sps.append(SamplingParams(temperature=0.9, seed=i, max_tokens=200,
                                  response_format=fmt.response_format(specs, choice)))  # fmt: skip
        wanted.append((f"f{i}", params))
    outs = tiny_llm.generate(prompts, sps)
    bad = []
    for (name, params), out in zip(wanted, outs, strict=True):
        calls = tools.parse_tool_calls(fmt, out["text"]).calls
        try:
            assert out["finish_reason"] == "stop" and calls, "no finished call"
            for call in calls:
                assert call.name == name, call.name
                jsonschema.validate(json.loads(call.arguments), params)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            bad.append((name, out["text"][:80], str(exc)[:120]))
    assert not bad, bad
