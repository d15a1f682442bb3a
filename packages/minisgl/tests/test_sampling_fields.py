"""Issue 64 item 1: the request parameters are defined once (`minisgl.sampling_fields`), and
`SamplingParams`, the HTTP parser, `/openapi.json`, the wire layout and the Rust service's wire
reader all follow that table. No model is loaded."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from minisgl.core import SamplingParams
from minisgl.server.protocol import APIError, parse_chat, parse_completion

ROOT = Path(__file__).resolve().parents[3]
CTX = 256

# (parameter, bad value): each refused offline and over HTTP
BAD: list[tuple[str, Any]] = [
    ("temperature", 3),
    ("temperature", 2.5),
    ("temperature", -1.0),
    ("temperature", "hot"),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_k", -3),
    ("top_k", 1.5),
    ("min_p", 1.5),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0),
    ("repetition_penalty", 2.1),
    ("n", 0),
    ("n", 129),
    ("n", 2.0),
    ("seed", -1),
    ("seed", "x"),
    ("stop", [""]),
    ("stop", ["x"] * 17),
    ("stop", 5),
    ("stop", ["ok", 5]),
    ("stop_token_ids", ["x"]),
    ("stop_token_ids", 5),
    ("logit_bias", {5: 101}),
    ("logit_bias", {5: "x"}),
    ("logit_bias", 5),
    ("min_tokens", -1),
    ("min_tokens", 3),
    ("priority", 2**31),
    ("priority", 1.5),
    ("max_tokens", 0),
    ("max_tokens", "10"),
    ("ignore_eos", "yes"),
    ("logprobs", 21),
    ("logprobs", -1),
]


def http_body(name: str, value: Any) -> dict:
    """The request body of one bad value (`logit_bias` keys are strings in JSON)."""
    if name == "logit_bias" and isinstance(value, dict):
        value = {str(k): v for k, v in value.items()}
    return {"prompt": "hi", "max_tokens": 2, name: value}


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v!r}"[:40] for n, v in BAD])
def test_offline_and_http_refuse_a_bad_value_with_the_same_message(name, value):
    """Test first: on the old code the messages differed (`'temperature' must be in [0.0, 2.0],
    got 3` over HTTP, `temperature must be >= 0 and <= 2.0, got 3` offline)."""
    with pytest.raises(APIError) as served:
        parse_completion(http_body(name, value), {"m"}, CTX)
    assert served.value.status == 400
    assert served.value.param == name
    with pytest.raises(ValueError) as offline:
        SamplingParams(**{"max_tokens": 2, name: value})
    assert str(offline.value) == served.value.message


def test_offline_temperature_over_two_is_the_servers_400():
    with pytest.raises(ValueError) as offline:
        SamplingParams(temperature=3)
    assert str(offline.value) == "temperature must be >= 0 and <= 2, got 3"


def test_the_endpoints_accept_the_tables_fields():
    from minisgl.sampling_fields import accepted
    from minisgl.server import protocol

    assert accepted("chat") == protocol.CHAT
    assert accepted("completions") == protocol.COMPLETION
    init = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    assert accepted("offline") == init


def test_sampling_params_defaults_are_the_tables():
    from minisgl.sampling_fields import fields_for

    params = SamplingParams()
    for name, f in fields_for("offline").items():
        assert getattr(params, name) == (f.default if name != "logit_bias" else ()), name


def test_http_defaults_are_the_tables():
    from minisgl.sampling_fields import fields_for

    p = parse_completion({"prompt": "hi"}, {"m"}, CTX).params
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, {"m"}, CTX).params
    assert chat.max_tokens == CTX  # chat: the context; completions: the table's 16
    for name, f in fields_for("completions").items():
        if hasattr(p, name) and name not in ("stop", "logprobs"):
            assert getattr(p, name) == f.http_default, name
    assert p.temperature == 1.0 and SamplingParams().temperature == 0.0  # OpenAI's / vLLM's


def test_openapi_is_generated_from_the_table():
    from minisgl.sampling_fields import INT64, fields_for
    from minisgl.server.openapi import request_bodies

    bodies = request_bodies(CTX)
    for endpoint, op in (("chat", "chat"), ("completions", "completions")):
        schema = bodies[op]["requestBody"]["content"]["application/json"]["schema"]
        props = schema["properties"]
        table = fields_for(endpoint, ignored=True)
        assert set(props) == set(table), endpoint
        for name, f in table.items():
            r, s = f.range, props[name]
            if r is None or f.kind not in ("number", "int"):
                continue
            if f.context_bound:
                assert s["maximum"] == CTX, name
            elif r.hi is not None:
                want = r.hi - 1 if (f.kind == "int" and r.hi_open) else r.hi
                assert s.get("maximum", s.get("exclusiveMaximum")) == want, name
            else:
                assert f.kind == "number" or s["maximum"] == INT64 - 1, name
            if r.lo is not None:
                key = "exclusiveMinimum" if r.lo_open and f.kind == "number" else "minimum"
                want = r.lo + 1 if (f.kind == "int" and r.lo_open) else r.lo
                assert s[key] == want, name
    props = bodies["chat"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert props["temperature"] == {
        "type": "number",
        "minimum": 0,
        "maximum": 2,
        "description": "below 1e-5: greedy (argmax)",
    }
    assert props["top_p"] == {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
    assert props["logprobs"] == {"type": "boolean"}


def test_the_wire_layout_is_the_tables():
    from minisgl.message.schema import WireParams
    from minisgl.sampling_fields import WIRE_FIELDS

    assert tuple(f.name for f in dataclasses.fields(WireParams)) == WIRE_FIELDS


def rust_source(path: str) -> str:
    return (ROOT / "rust" / path).read_text()


def test_the_rust_wire_reader_reads_the_tables_layout():
    """The Rust service keeps its own reader of the wire params (`wire.rs::params`): its field
    count and every index it reads name the table's field at that index."""
    from minisgl.sampling_fields import WIRE_FIELDS

    src = rust_source("minisgl-cpu-service/src/wire.rs")
    count = re.search(r"pub const PARAMS_FIELDS: usize = (\d+);", src)
    assert count and int(count.group(1)) == len(WIRE_FIELDS)
    body = src[src.index("fn params(") :]
    body = body[: body.index("\n}\n")]
    reads = set(re.findall(r"items\[(\d+)\],\s*\"(\w+)\"", body))
    assert len(reads) >= 8
    for index, name in reads:
        assert WIRE_FIELDS[int(index)] == name, (index, name)


def test_the_rust_vocabulary_checks_say_what_python_says():
    from minisgl.sampling_fields import vocab_error

    src = rust_source("minisgl-cpu-service/src/service.rs")
    for prefix in ("", "logit_bias "):
        rust = vocab_error("{bad}", "{vocab}", prefix.strip() or None)
        assert f'format!("{rust}")' in src, rust


def test_offline_logit_bias_outside_the_vocabulary_is_the_servers_error(tiny_model_dir):
    """Test first: offline, a `logit_bias` id outside the vocabulary failed the step with an
    IndexError from the sampler; the server answers 400 with `vocab_error`. Now both refuse it
    before anything is queued, with the same message."""
    from minisgl import LLM
    from minisgl.sampling_fields import vocab_error

    llm = LLM(str(tiny_model_dir("llama")), num_pages=512, max_seq_len_override=CTX)
    try:
        vocab = llm.engine.model_config.vocab_size
        with pytest.raises(ValueError) as e:
            llm.generate([[5, 6]], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))
        assert str(e.value) == vocab_error(vocab, vocab, "logit_bias")
        assert not llm.has_work()
        with pytest.raises(ValueError) as e:
            llm.generate([[5, vocab]])
        assert str(e.value) == vocab_error(vocab, vocab)
    finally:
        llm.close()


def rust_messages(path: str, fn: str) -> list[re.Pattern]:
    """The string literals of a Rust function, as patterns (`{...}`: a number)."""
    src = rust_source(path)
    body = src[src.index(f"pub fn {fn}(") :]
    body = body[: body.index("\n}\n")]
    out = []
    for lit in re.findall(r'"((?:[^"\\]|\\.)*)"', body, re.S):
        text = re.sub(r"\\\n\s*", "", lit)  # a literal continued on the next line
        parts = re.split(r"\{\w*\}", text)
        out.append(re.compile(r"(\d+)".join(re.escape(p) for p in parts)))
    return out


def test_the_rust_validate_request_says_what_python_says():
    """The Rust core keeps its own `validate_request` (the service's admission check); each
    refusal of the Python one is a message the Rust one writes."""
    from minisgl.scheduler.request import RequestError, validate_request

    rust = rust_messages("minisgl-cpu-core/src/sched.rs", "validate_request")
    cases = [([], 4, 16, 4), ([1] * 16, 4, 16, 4), ([1, 2, 3], 10, 16, 1)]
    for prompt, max_tokens, max_seq_len, num_pages in cases:
        with pytest.raises(RequestError) as e:
            validate_request(prompt, SamplingParams(max_tokens=max_tokens), max_seq_len,
                             num_pages, 4)  # fmt: skip
        assert any(p.fullmatch(str(e.value)) for p in rust), str(e.value)


def test_the_wire_carries_every_sampling_field():
    """Test first: `service_plane.wire_params` (the offline rust_service path) listed the
    fields by hand and dropped `priority`; packed from the table, every field of the wire comes
    back from `to_sampling_params` as it was (stop strings stay with the detokenizer)."""
    from minisgl.runtime.service_plane import wire_params

    p = SamplingParams(temperature=0.5, top_k=7, top_p=0.9, max_tokens=9, ignore_eos=False,
                       seed=11, stop=["x"], stop_token_ids=[3], presence_penalty=0.5,
                       frequency_penalty=-0.5, repetition_penalty=1.5, min_p=0.1,
                       logit_bias={5: 2.0}, min_tokens=2, logprobs=3, priority=4,
                       response_format={"type": "json_object"})  # fmt: skip
    wire = wire_params(p, leader=12)
    assert wire.prefix_leader == 12 and wire.stop == ["x"] and wire.priority == 4
    back = wire.to_sampling_params()
    assert back == dataclasses.replace(p, stop=None)
