"""Issue 38, tool calling on the OpenAI server (a tiny random llama given a Qwen-like chat
template that renders the tools in few tokens): `tools` + `tool_choice` through the openai
client, whole and streamed, `parse` with pydantic models, 400s naming the field, and the same
calls from the python and rust_service control planes."""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest

from minisgl.testing.modules import require_module
from minisgl.testing.schemas import PARAMS, TOOLS, UNSORTED_ORDER, UNSORTED_TOOL, WEATHER
from minisgl.testing.server import running_server, start
from minisgl.testing.tiny_models import write_tiny_model

CARD = "P3-002"
RED = "tool-calling-tests-fail-before-the-tools-exist"
GREEN = "tool-calling-tests-pass"

MESSAGES = [{"role": "user", "content": "What is the weather in Paris? And 2 + 3?"}]
NAMED = {"type": "function", "function": {"name": "add"}}


# Qwen2.5's layout, the tools listed by name only: the tiny tokenizer spends a token on every
# one or two characters, and the harness's tiny models hold 512 positions
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} "
    "{% endfor %}<tool_call></tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
FLAGS = ("--max-seq-len-override", "512")


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    path = write_tiny_model("llama", tmp_path_factory.mktemp("tools-llama"), seed=0)
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def server(tool_model, tmp_path_factory):
    """The python control plane on the tool model (this module's own server)."""
    with running_server(tool_model, *FLAGS, log_dir=tmp_path_factory.mktemp("tools-log")) as s:
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def model(server) -> str:
    return client(server).models.list().data[0].id


def create(server, **kw) -> Any:
    """`chat.completions.create`; an error status fails the test by assertion."""
    try:
        return client(server).chat.completions.create(**kw)
    except openai.APIStatusError as exc:
        raise AssertionError(f"{exc.status_code}: {exc.response.text}") from None


def check_calls(calls, names: set[str]) -> list[tuple[str, str]]:
    jsonschema = require_module("jsonschema")
    assert calls, "no tool calls"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function", call
        assert call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    return [(c.function.name, c.function.arguments) for c in calls]


def joined_stream(server, **kw) -> tuple[str | None, list[dict], str | None]:
    """A stream joined as OpenAI's docs join `delta.tool_calls` (by index)."""
    content: str | None = None
    calls: dict[int, dict] = {}
    finish = None
    for chunk in create(server, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            if d.content:
                content = (content or "") + d.content
            for tc in d.tool_calls or ():
                if tc.index not in calls:
                    assert tc.id and tc.id.startswith("call_") and tc.function.name, tc
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


API = "tools-and-tool-choice-on-the-chat-endpoint-whole-and-streamed"


@pytest.mark.card(CARD, API, RED, GREEN)
@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_tool_calls(server, model, choice):
    tool_choice = NAMED if choice == "named" else "required"
    r = create(server, model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
               temperature=0.9, seed=4, max_tokens=160, n=2,
               parallel_tool_calls=False)  # fmt: skip
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls", ch
        assert ch.message.content is None, ch.message
        check_calls(ch.message.tool_calls, {"add"} if choice == "named" else set(PARAMS))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_named_tool_choice_gives_one_call(server, model, stream):
    """Issue 60: a named `tool_choice` (parallel_tool_calls left to its default) returned the
    same call twice: its grammar allowed any number of calls of the function. Forcing one
    function is one call (as OpenAI and vLLM answer it)."""
    for seed in range(3):
        kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                  temperature=1.0, seed=seed, max_tokens=160)  # fmt: skip
        if stream:
            _, calls, finish = joined_stream(server, **kw)
            got = [(c["name"], c["arguments"]) for c in calls]
        else:
            ch = create(server, **kw).choices[0]
            finish, got = ch.finish_reason, check_calls(ch.message.tool_calls, {"add"})
        assert finish == "tool_calls" and len(got) == 1, (seed, got)
        assert got[0][0] == "add"


@pytest.mark.card(CARD, API, RED, GREEN)
def test_auto_gives_text_or_valid_calls_and_none_gives_text(server, model):
    for seed in range(3):
        r = create(server, model=model, messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                   temperature=1.0, seed=seed, max_tokens=48)  # fmt: skip
        msg = r.choices[0].message
        if msg.tool_calls:
            check_calls(msg.tool_calls, set(PARAMS))
            assert r.choices[0].finish_reason == "tool_calls"
        else:
            assert isinstance(msg.content, str)
    r = create(server, model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none",
               max_tokens=16)  # fmt: skip
    assert r.choices[0].message.tool_calls is None
    assert isinstance(r.choices[0].message.content, str)


@pytest.mark.card(CARD, API, RED, GREEN)
@pytest.mark.parametrize("choice", ["required", "named"])
def test_streamed_calls_join_to_the_whole_answer(server, model, choice):
    tool_choice = NAMED if choice == "named" else "required"
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
              temperature=0.0, max_tokens=160, parallel_tool_calls=False)  # fmt: skip
    whole = create(server, **kw).choices[0]
    content, calls, finish = joined_stream(server, **kw)
    assert finish == "tool_calls" == whole.finish_reason
    assert content is None
    assert [(c["name"], c["arguments"]) for c in calls] == check_calls(
        whole.message.tool_calls, set(PARAMS)
    )


@pytest.mark.card(CARD, API, RED, GREEN)
def test_a_conversation_with_tool_results_continues(server, model):
    first = create(server, model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                   temperature=0.0, max_tokens=160,
                   parallel_tool_calls=False).choices[0].message  # fmt: skip
    call = first.tool_calls[0]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": 5})},
    ]
    r = create(server, model=model, messages=history, tools=TOOLS, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_call_arguments_keep_the_parameters_order(server, model, stream):
    """Issue 60: a function's parameters `zebra, apple, mango` gave arguments in sorted order
    (the schema was sorted before the grammar was built)."""
    kw = dict(model=model, messages=MESSAGES, tools=[UNSORTED_TOOL], tool_choice="required",
              temperature=0.0, max_tokens=120, parallel_tool_calls=False)  # fmt: skip
    if stream:
        _, calls, finish = joined_stream(server, **kw)
        args = [c["arguments"] for c in calls]
    else:
        ch = create(server, **kw).choices[0]
        finish, args = ch.finish_reason, [c.function.arguments for c in ch.message.tool_calls]
    assert finish == "tool_calls" and len(args) == 1, args
    assert list(json.loads(args[0])) == UNSORTED_ORDER, args


class Pick(pydantic.BaseModel):
    ok: bool
    pick: Literal["a", "b", "c"]


class Add(pydantic.BaseModel):
    a: Literal[1, 2, 3]
    b: bool


@pytest.mark.card(CARD, "the-openai-client-s-tools-and-parse-examples-run-unchanged", RED, GREEN)
def test_openai_parse_with_pydantic_response_format_and_tools(server, model):
    c = client(server)
    try:
        r = c.chat.completions.parse(model=model, messages=MESSAGES, response_format=Pick,
                                     max_tokens=48)  # fmt: skip
        assert isinstance(r.choices[0].message.parsed, Pick)
        r = c.chat.completions.parse(
            model=model,
            messages=MESSAGES,
            tools=[openai.pydantic_function_tool(Add)],
            tool_choice="required",
            max_tokens=160,
            parallel_tool_calls=False,
        )
    except openai.APIStatusError as exc:
        raise AssertionError(f"{exc.status_code}: {exc.response.text}") from None
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "Add"
    assert isinstance(call.function.parsed_arguments, Add)


@pytest.mark.card(CARD, "the-openai-client-s-tools-and-parse-examples-run-unchanged", RED, GREEN)
def test_openai_stream_helper_accumulates_tool_calls(server, model):
    c = client(server)
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
              temperature=0.0, max_tokens=160, parallel_tool_calls=False)  # fmt: skip
    try:
        with c.chat.completions.stream(**kw) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
    except openai.APIStatusError as exc:
        raise AssertionError(f"{exc.status_code}: {exc.response.text}") from None
    check_calls(final.choices[0].message.tool_calls, set(PARAMS))


BAD: list[tuple[dict, str]] = [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nope"}}}}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]  # fmt: skip


@pytest.mark.card(CARD, "bad-tool-requests-are-400s-naming-the-field", RED, GREEN)
def test_bad_tool_requests_are_400s_and_the_server_goes_on(server, model):
    for extra, param in BAD:
        body = {"model": model, "messages": MESSAGES, "max_tokens": 4, **extra}
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", (extra, err)
    r = create(server, model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
               max_tokens=160, seed=1, parallel_tool_calls=False)  # fmt: skip
    check_calls(r.choices[0].message.tool_calls, set(PARAMS))


@pytest.fixture(scope="module")
def rust_server(tool_model, tmp_path_factory):
    with start("rust_service", tool_model, *FLAGS, backend="rust_service",
               log_dir=tmp_path_factory.mktemp("tools-svc-log")) as s:  # fmt: skip
        yield s


@pytest.mark.card(CARD, "both-control-planes-give-the-same-tool-calls", RED, GREEN)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_python_and_rust_service_give_the_same_calls(server, rust_server, model, stream):
    svc = rust_server.get()
    for tool_choice, seed in (("required", 3), (NAMED, 5), ("auto", 7)):
        kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                  temperature=0.8, seed=seed, max_tokens=96)  # fmt: skip
        answers = []
        for s in (server, svc):
            if stream:
                content, calls, finish = joined_stream(s, **kw)
                answers.append((content, [(c["name"], c["arguments"]) for c in calls], finish))
            else:
                ch = create(s, **kw).choices[0]
                calls = [(c.function.name, c.function.arguments)
                         for c in ch.message.tool_calls or ()]  # fmt: skip
                answers.append((ch.message.content, calls, ch.finish_reason))
        assert answers[0] == answers[1], (tool_choice, answers)
        if tool_choice != "auto":
            assert answers[0][1], answers[0]
