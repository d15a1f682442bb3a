"""Issue 38: `response_format` on both endpoints of the OpenAI server (tiny random llama, so
the schemas leave the model few choices and end soon): outputs parse and validate, streamed
deltas too; bad formats are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from minisgl.testing.modules import require_module
from minisgl.testing.schemas import UNSORTED, UNSORTED_ORDER

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["a", "b", "c"]}},
    "required": ["ok", "pick"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"]


def post(server, endpoint: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{endpoint}", json=body, timeout=60)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_response_format_json_schema_validates(server, model, endpoint, temperature):
    jsonschema = require_module("jsonschema")
    body = {"model": model, "max_tokens": 48, "temperature": temperature, "seed": 11, "n": 2,
            "response_format": FORMAT}  # fmt: skip
    if endpoint == "completions":
        body["prompt"] = "Answer:"
    else:
        body["messages"] = [{"role": "user", "content": "Answer in JSON."}]
    r = post(server, endpoint, body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
        jsonschema.validate(json.loads(text), SCHEMA)
        assert choice["finish_reason"] == "stop"


def test_streamed_constrained_output_parses(server, model):
    body = {"model": model, "max_tokens": 48, "stream": True, "response_format": FORMAT,
            "messages": [{"role": "user", "content": "JSON please."}]}  # fmt: skip
    text = ""
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
    assert set(json.loads(text)) == {"ok", "pick"}


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_properties_come_out_in_the_schema_s_order(server, model, endpoint):
    """Issue 60: properties `zebra, apple, mango` came out sorted (`{"apple":..,"mango":..,
    "zebra":..}`): the schema was serialised with sorted keys before it was compiled."""
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": UNSORTED}}
    body = {"model": model, "max_tokens": 48, "temperature": 0.0, "response_format": fmt}
    if endpoint == "completions":
        body["prompt"] = "Answer:"
    else:
        body["messages"] = [{"role": "user", "content": "Answer in JSON."}]
    r = post(server, endpoint, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
    assert choice["finish_reason"] == "stop", text
    assert list(json.loads(text)) == UNSORTED_ORDER, text


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
        {"response_format": {"type": "yaml"}},
        {"response_format": {"type": "json_object"}, "ignore_eos": True},
    ],
)
def test_bad_response_format_is_a_400_naming_the_field(server, model, extra):
    r = post(server, "completions", {"model": model, "prompt": "x", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format", err
