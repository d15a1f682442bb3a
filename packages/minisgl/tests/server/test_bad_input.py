"""Every bad input gets a 4xx with an OpenAI-style error body; the server keeps serving."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest

from minisgl import ipc
from minisgl.message.schema import Reject
from minisgl.server.args import parse_args
from minisgl.server.frontend import Frontend, Job, ReqState
from minisgl.server.mailbox import Failure
from minisgl.server.protocol import APIError, parse_chat, parse_completion
from minisgl.testing.bad_requests import CASES, CHAT, LONG_IDS, POISON
from minisgl.testing.server import metric


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None = "any", code=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "any":
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize(
    "endpoint,body,status,param,code", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_bad_request(http, endpoint, body, status, param, code):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    assert_error(http.post(path, json=body), status, param, code)


def test_empty_prompt(http):
    """Issue 60: the empty prompt's 400 had `param: null`."""
    err = assert_error(http.post("/v1/completions", json={"prompt": ""}), 400, "prompt")
    assert "empty" in err["message"]
    err = assert_error(http.post("/v1/completions", json={"prompt": "", "stream": True}), 400)
    assert err["param"] == "prompt"


def test_role_error_lists_every_accepted_role(http):
    """Issue 60: the message omitted `developer`, which is accepted."""
    body = {"messages": [{"role": "wizard", "content": "x"}]}
    err = assert_error(http.post("/v1/chat/completions", json=body), 400, "messages[0].role")
    assert err["message"] == (
        "messages[0].role must be system, developer, user, assistant or tool, got 'wizard'"
    )


@pytest.mark.parametrize("value", [True, False])
def test_completions_logprobs_is_a_count_not_a_boolean(http, value):
    """Issue 60: `logprobs: true` on /v1/completions (the legacy API's integer, as OpenAI and
    vLLM define it) is a 400 naming the parameter and saying what it takes."""
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": value})
    err = assert_error(r, 400, "logprobs", "invalid_type")
    assert err["message"] == (
        f"'logprobs' on /v1/completions is the number of top logprobs per token, an integer "
        f"in [0, 20]; got {str(value).lower()} (a boolean 'logprobs' with 'top_logprobs' is "
        "/v1/chat/completions' form)"
    )


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"str"', b"null"])
def test_malformed_body(http, raw):
    r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400)


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404, None, "not_found")
    # issue 60: the 405 body had `code: null`
    assert_error(http.get("/v1/chat/completions"), 405, None, "method_not_allowed")
    assert_error(http.delete("/health"), 405, None, "method_not_allowed")


def test_openai_client_sees_typed_errors(server):
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=30, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model="x" if False else c.models.list().data[0].id, messages=CHAT, n=0
        )
    assert "n" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="hi")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_unknown_model_names_the_served_model_never_a_path(http, server, endpoint):
    """Issue 60: the 404 said `this server serves '<the model folder's path>'`."""
    served = http.get("/v1/models").json()["data"][0]["id"]
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    body = {"model": "gpt-4", "max_tokens": 2}
    body.update({"messages": CHAT} if endpoint == "chat" else {"prompt": "hi"})
    err = assert_error(http.post(path, json=body), 404, "model", "model_not_found")
    assert err["message"] == f"the model 'gpt-4' does not exist; this server serves '{served}'"
    assert str(server.model_dir) not in err["message"]


def test_served_model_name_is_the_only_name_errors_show(tiny_model_dir):
    """Issue 60: with --served-model-name smol an unknown model's 404 named the model path;
    an error a worker sends that holds the path shows the served name instead."""
    model = str(tiny_model_dir("llama"))
    ipc_dir = ipc.make_ipc_dir("/tmp")
    fe = Frontend(
        parse_args(["--model-path", model, "--served-model-name", "smol"]), model, ipc_dir
    )
    try:
        for parse, body in ((parse_chat, {"messages": CHAT}), (parse_completion, {"prompt": "x"})):
            with pytest.raises(APIError) as e:
                parse({"model": "gpt-4", **body}, fe.model_names, 256)
            assert e.value.message == "the model 'gpt-4' does not exist; this server serves 'smol'"
            for name in ("smol", model):  # the model path is still accepted, never shown
                assert parse({"model": name, **body}, fe.model_names, 256).model == name
        job = Job([])
        job.states.append(st := ReqState(7, 0, job.mailbox))
        fe.reqs[7] = st
        fe._dispatch([Reject(7, f"cannot load the tokenizer of {model}", 500, "internal_error")])
        item = job.mailbox.pop()
        assert isinstance(item, Failure) and item.error.message == (
            "cannot load the tokenizer of smol"
        )
    finally:
        fe.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def test_server_keeps_serving_after_bad_input(http):
    for _ in range(3):
        http.post("/v1/completions", content=b"{oops")
        http.post("/v1/completions", json={"prompt": LONG_IDS})
    r = http.post(
        "/v1/completions",
        json={"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert http.get("/health").status_code == 200


def in_flight(http) -> float:
    return metric(http.get("/metrics").text, "minisgl_requests_in_flight")


@pytest.mark.parametrize("endpoint,raw,param", POISON, ids=[f"poison-{i}" for i in range(6)])
def test_unencodable_input_is_400_and_releases_its_slot(http, endpoint, raw, param):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    headers = {"content-type": "application/json"}
    for _ in range(40):  # a flood: every one must be answered and released
        r = http.post(path, content=raw, headers=headers)
        err = assert_error(r, 400)
        if param is not None:
            assert err["param"] == param, err
    assert http.get("/health").json()["in_flight"] == 0
    assert in_flight(http) == 0
    ok = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"prompt": [' + b"7" * 5000 + b"]}",
    ],
    ids=["deep-nesting", "5000-digit-max-tokens", "5000-digit-token-id"],
)
def test_pathological_json_is_400(http, raw):
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert http.get("/health").json()["in_flight"] == 0


def test_text_that_cannot_fit_is_refused_before_tokenizing(http, llm_ref):
    """A huge prompt must not stall the tokenizer (every other request waits behind it)."""
    from minisgl.tokenizer.worker import max_token_chars

    n = 256 * max_token_chars(llm_ref.tokenizer) + 1
    r = http.post("/v1/completions", json={"prompt": "a" * n})
    err = assert_error(r, 400, "prompt", "context_length_exceeded")
    assert "before tokenizing" in err["message"]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * n}]})
    assert_error(r, 400, "messages", "context_length_exceeded")
    assert http.get("/health").json()["in_flight"] == 0
