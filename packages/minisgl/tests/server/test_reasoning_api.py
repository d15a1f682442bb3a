"""Issue 63 item 3 over HTTP: `--reasoning-parser qwen3` on a tiny random Qwen3 whose template
opens `<think>` (`minisgl.testing.tiny_reasoning`): `reasoning_content` and `content`
separated, whole and streamed (`delta.reasoning_content`), as the raw output of the same
seeded request splits; `chat_template_kwargs` reaches the template (`enable_thinking`);
json_schema and tool calls constrain the answer after the reasoning; usage counts unchanged;
bad input is a 400 / exit 2. A `logit_bias` on `</think>` makes the random model close its
reasoning within a few tokens."""

from __future__ import annotations

import json

import httpx
import pytest

from minisgl.testing.modules import require_module
from minisgl.testing.schemas import TOOLS
from minisgl.testing.server import running_server, start
from minisgl.testing.tiny_reasoning import think_end_id, write_tiny_reasoning_model

CARD = "P3-004"
RED = "reasoning-tests-fail-before-the-parsers-exist"
GREEN = "reasoning-tests-pass"
SERVE = "the-server-separates-reasoning-whole-and-streamed"
AFTER = "tools-and-response-format-apply-after-the-reasoning"
KWARGS = "chat-template-kwargs-reach-the-template"
BAD = "bad-reasoning-input-is-a-clear-error"
PLANES = "both-control-planes-give-the-same-reasoning"

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
          "maximum": 99}}, "required": ["a"], "additionalProperties": False}  # fmt: skip
BIAS = 4.0  # on </think>: the reasoning ends after a few tokens, seldom at once


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    return write_tiny_reasoning_model(tmp_path_factory.mktemp("think-qwen3"))


FLAGS = ("--max-seq-len-override", "512", "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def server(think_model, tmp_path_factory):
    with running_server(think_model, *FLAGS, log_dir=tmp_path_factory.mktemp("think-log")) as s:
        yield s


@pytest.fixture(scope="module")
def rust_server(think_model, tmp_path_factory):
    with start("rust_service", think_model, *FLAGS, backend="rust_service",
               log_dir=tmp_path_factory.mktemp("think-svc-log")) as s:  # fmt: skip
        yield s


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.base_url}/v1/{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions",
                      json={**body, "stream": True}, timeout=120) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def joined(chunks: list[dict], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


def raw_completion(server, think_model, body: dict, **template_kwargs) -> dict:
    """The same seeded request as a completion of the rendered prompt: the unparsed text."""
    from minisgl.tokenizer.load import load_tokenizer

    tok = load_tokenizer(str(think_model))
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False,
                                   **template_kwargs)  # fmt: skip
    ids = tok(text, add_special_tokens=False)["input_ids"]
    keep = {k: v for k, v in body.items() if k not in ("messages", "chat_template_kwargs")}
    return post(server, "completions", {**keep, "prompt": ids})


def reference(text: str, inside: bool) -> tuple[str | None, str]:
    """The split, written plainly (as the offline tests' reference)."""
    if not inside:
        s = text.lstrip()
        if not s.startswith("<think>"):
            return None, text
        rest = s[len("<think>") :]
    else:
        rest = text
        if rest.lstrip().startswith("<think>"):
            rest = rest.lstrip()[len("<think>") :]
    i = rest.find("</think>")
    if i < 0:
        return rest.strip(), ""
    return rest[:i].strip(), rest[i + len("</think>") :].lstrip()


def body_for(think_model, seed: int, **kw) -> dict:
    return {"messages": MESSAGES, "max_tokens": 40, "temperature": 1.0, "seed": seed,
            "logit_bias": {str(think_end_id(think_model)): BIAS}, **kw}  # fmt: skip


@pytest.mark.card(CARD, SERVE, RED, GREEN)
def test_reasoning_and_content_are_separated_whole_and_streamed(server, think_model):
    both = 0
    for seed in range(4):
        body = body_for(think_model, seed)
        out = post(server, "chat/completions", body)
        msg = out["choices"][0]["message"]
        raw = raw_completion(server, think_model, body)
        reasoning, content = reference(raw["choices"][0]["text"], inside=True)
        assert (msg["reasoning_content"], msg["content"]) == (reasoning, content), raw
        assert out["usage"] == raw["usage"]  # the split changes no count
        chunks = stream(server, {**body, "stream_options": {"include_usage": True}})
        assert joined(chunks, "reasoning_content") == reasoning
        assert joined(chunks, "content") == content
        assert chunks[-1]["usage"] == raw["usage"]
        both += bool(reasoning) and bool(content)
    assert both, "no seed gave both reasoning and content"


@pytest.mark.card(CARD, KWARGS, RED, GREEN)
def test_enable_thinking_false_reaches_the_template(server, think_model):
    for seed in range(2):
        body = body_for(think_model, seed, chat_template_kwargs={"enable_thinking": False})
        msg = post(server, "chat/completions", body)["choices"][0]["message"]
        raw = raw_completion(server, think_model, body, enable_thinking=False)
        reasoning, content = reference(raw["choices"][0]["text"], inside=False)
        assert (msg.get("reasoning_content"), msg["content"]) == (reasoning, content)
        chunks = stream(server, body)
        assert joined(chunks, "content") == content


@pytest.mark.card(CARD, AFTER, RED, GREEN)
def test_json_schema_constrains_the_content_after_the_reasoning(server, think_model):
    jsonschema = require_module("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    for seed in range(3):
        body = body_for(think_model, seed, response_format=fmt, max_tokens=120)
        out = post(server, "chat/completions", body)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert isinstance(choice["message"]["reasoning_content"], str)
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        chunks = stream(server, body)
        assert joined(chunks, "content") == choice["message"]["content"]
        assert joined(chunks, "reasoning_content") == choice["message"]["reasoning_content"]


@pytest.mark.card(CARD, AFTER, RED, GREEN)
def test_tool_calls_are_parsed_from_the_content_after_the_reasoning(server, think_model):
    jsonschema = require_module("jsonschema")
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        body = body_for(think_model, seed, tools=TOOLS, tool_choice="required",
                        parallel_tool_calls=False, max_tokens=160)  # fmt: skip
        choice = post(server, "chat/completions", body)["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        msg = choice["message"]
        assert isinstance(msg["reasoning_content"], str)
        assert "</think>" not in (msg["content"] or "")
        (call,) = msg["tool_calls"]
        fn = call["function"]
        jsonschema.validate(json.loads(fn["arguments"]), params[fn["name"]])
        chunks = stream(server, body)
        assert joined(chunks, "reasoning_content") == msg["reasoning_content"]
        deltas = [tc for c in chunks if c["choices"]
                  for tc in c["choices"][0]["delta"].get("tool_calls") or []]  # fmt: skip
        assert deltas[0]["function"]["name"] == fn["name"]
        assert "".join(d["function"]["arguments"] for d in deltas) == fn["arguments"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.card(CARD, BAD, RED, GREEN)
@pytest.mark.parametrize("value", [["enable_thinking"], "x", 3, True])
def test_chat_template_kwargs_not_an_object_is_a_400(server, value):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30,
                   json={"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": value})  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template_kwargs" and err["code"] == "invalid_type"


@pytest.mark.card(CARD, BAD, RED, GREEN)
def test_chat_template_kwargs_that_shadow_the_chat_are_a_400(server):
    kw = {"messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30,
                   json={"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": kw})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.card(CARD, BAD, RED, GREEN)
def test_an_unknown_reasoning_parser_exits_2(capsys):
    from minisgl.server.args import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--reasoning-parser", "qwen9"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--reasoning-parser" in err and "qwen3" in err
    assert parse_args([]).reasoning_parser is None
    assert parse_args(["--reasoning-parser", "deepseek-r1"]).reasoning_parser == "deepseek-r1"


@pytest.mark.card(CARD, PLANES, RED, GREEN)
def test_python_and_rust_service_give_the_same_reasoning(server, rust_server, think_model):
    svc = rust_server.get()
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    for extra in ({}, {"response_format": fmt, "max_tokens": 120},
                  {"chat_template_kwargs": {"enable_thinking": False}}):  # fmt: skip
        body = body_for(think_model, 1, **extra)
        answers = []
        for s in (server, svc):
            out = post(s, "chat/completions", body)
            msg = out["choices"][0]["message"]
            chunks = stream(s, body)
            answers.append((msg.get("reasoning_content"), msg["content"], out["usage"],
                            joined(chunks, "reasoning_content"), joined(chunks, "content")))  # fmt: skip
        assert answers[0] == answers[1], (extra, answers)
