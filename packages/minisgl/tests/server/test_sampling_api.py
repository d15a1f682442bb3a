"""Sampling parameters over HTTP (openai client, both endpoints) and parallel sampling (n)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from minisgl import SamplingParams

CHAT = [{"role": "user", "content": "Tell me about foxes"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.4)
EXTRA = dict(repetition_penalty=1.3, min_tokens=6, min_p=0.1)


def test_penalties_match_offline_on_both_endpoints(client, model, llm_ref):
    want_params = SamplingParams(max_tokens=12, **PENALTIES, **EXTRA)
    want = llm_ref.generate(["the fox and the fox"], want_params)[0]
    r = client.completions.create(
        model=model, prompt="the fox and the fox", max_tokens=12, temperature=0,
        extra_body=EXTRA, **PENALTIES,
    )  # fmt: skip
    assert r.choices[0].text == want["text"]
    assert r.usage.completion_tokens == len(want["token_ids"]) >= 6
    want = llm_ref.generate([CHAT], want_params)[0]
    c = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=12, temperature=0, extra_body=EXTRA, **PENALTIES
    )
    assert c.choices[0].message.content == want["text"]


def test_logit_bias_forces_a_token(client, model, llm_ref):
    tok = 100
    text = llm_ref.tokenizer.decode([tok] * 5)
    r = client.completions.create(
        model=model, prompt="hi", max_tokens=5, temperature=0, logit_bias={str(tok): 100},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].text == text
    c = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=5, temperature=0.7, logit_bias={str(tok): 100},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert c.choices[0].message.content == text


def test_n_choices_both_endpoints(client, model):
    kw = dict(model=model, max_tokens=8, temperature=1.0, seed=11, n=3)
    a = client.completions.create(prompt="Once upon a time", **kw)
    b = client.completions.create(prompt="Once upon a time", **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seed, seed+1, seed+2
    assert len({c.text for c in a.choices}) > 1
    assert a.usage.completion_tokens == 24 or all(c.finish_reason for c in a.choices)
    chat = client.chat.completions.create(messages=CHAT, **kw)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    stream = client.chat.completions.create(
        messages=CHAT, stream=True, stream_options={"include_usage": True}, **kw
    )
    texts, finished, usage = ["", "", ""], set(), None
    for ch in stream:
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    assert texts == [c.message.content for c in chat.choices]
    assert usage.completion_tokens == chat.usage.completion_tokens


def test_continuous_usage_stats(server, model):
    body = {
        "model": model, "prompt": "count", "max_tokens": 6, "temperature": 0, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True},
    }  # fmt: skip
    seen = []
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.append(json.loads(line[6:])["usage"]["completion_tokens"])
    assert seen == sorted(seen) and seen[-1] == 6 and len(seen) >= 2


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_continuous_usage_stats_count_the_prompt_from_the_first_chunk(server, model, endpoint):
    """Issue 60: the chat stream's first chunk (the role) said `prompt_tokens: 0`."""
    body = {"model": model, "max_tokens": 4, "temperature": 0, "stream": True, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    body.update({"prompt": "count"} if endpoint == "completions" else {"messages": CHAT})
    usages = []
    with httpx.stream("POST", f"{server.base_url}/v1/{endpoint}", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usages.append(json.loads(line[6:])["usage"])
    prompt = usages[-1]["prompt_tokens"]
    assert prompt > 0 and len(usages) >= 3
    assert [u["prompt_tokens"] for u in usages] == [prompt] * len(usages)
    assert all(u["total_tokens"] == prompt + u["completion_tokens"] for u in usages)


def test_logprobs_both_endpoints_match_offline(client, model, llm_ref):
    want = llm_ref.generate(["the fox"], SamplingParams(max_tokens=6, logprobs=3))[0]
    r = client.completions.create(
        model=model, prompt="the fox", max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text == want["text"]
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want["logprobs"]], abs=1e-4)
    assert lp.text_offset[0] == 0
    for got, w in zip(lp.top_logprobs, want["logprobs"], strict=True):
        names = llm_ref.tokenizer.batch_decode([[t] for t, _ in w.top])
        assert set(got) == set(names)  # (tokens that decode alike share one key, as in vLLM)
        for name, (_, v) in zip(names, w.top, strict=True):
            if names.count(name) == 1:
                assert got[name] == pytest.approx(v, abs=1e-4)
    want = llm_ref.generate([CHAT], SamplingParams(max_tokens=6, logprobs=2))[0]
    c = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = c.choices[0].logprobs.content
    assert "".join(x.token for x in content) == c.choices[0].message.content == want["text"]
    assert [x.logprob for x in content] == pytest.approx(
        [x.logprob for x in want["logprobs"]], abs=1e-4
    )
    assert all(len(x.top_logprobs) == 2 and bytes(x.bytes).decode() == x.token for x in content)
    # streaming: one logprob entry per generated token, in order
    stream = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, stream=True
    )
    entries = [e for ch in stream for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx([x.logprob for x in content], abs=1e-4)
    no = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2)
    assert no.choices[0].logprobs is None


def test_stream_starts_once_queued_with_data_lines_only(server, model):
    """The response (status and headers) starts once the scheduler queued the request, not at
    the first token; errors found before that stay plain 4xx (see test_bad_input). The body
    holds only `data:` lines (issue 41: no SSE comment, which peer clients cannot parse)."""
    body = {"model": model, "prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[0].startswith("data: {")
    assert lines[-1] == "data: [DONE]"
