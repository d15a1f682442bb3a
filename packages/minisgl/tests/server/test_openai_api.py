"""The official openai client against a real server: sync + async, streaming or not."""

from __future__ import annotations

import asyncio
import json
import os
import re

import httpx
import openai
import pytest

from minisgl import SamplingParams

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Paris is the capital of"}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def ref(llm_ref, prompt, max_tokens, **kw):
    out = llm_ref.generate(prompt, SamplingParams(max_tokens=max_tokens, **kw))[0]
    return out


def test_health_and_models(server, client):
    h = httpx.get(server.base_url + "/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert set(h.json()["workers"]) == {"scheduler", "tokenizer0"}
    models = client.models.list().data
    assert len(models) == 1 and models[0].object == "model"
    # the model folder's name, never a local path; every response says the same
    assert models[0].id == os.path.basename(str(server.model_dir)) and "/" not in models[0].id
    r = client.completions.create(model=models[0].id, prompt="hi", max_tokens=1)
    assert r.model == models[0].id


def test_completion_matches_llm_generate(client, model, llm_ref):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    want = ref(llm_ref, PROMPT, 24)
    assert r.object == "text_completion"
    assert r.choices[0].text == want["text"]
    assert r.choices[0].finish_reason == want["finish_reason"]
    assert r.usage.completion_tokens == len(want["token_ids"])
    assert r.usage.prompt_tokens == want["prompt_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_token_ids_prompt(client, model, llm_ref):
    ids = [5, 17, 33, 101, 250, 7]
    r = client.completions.create(
        model=model, prompt=ids, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    want = ref(llm_ref, [ids], 12, ignore_eos=True)
    assert r.choices[0].text == want["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(ids)


def test_chat_matches_llm_generate(client, model, llm_ref):
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=20, temperature=0)
    want = ref(llm_ref, CHAT, 20)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want["text"]
    assert r.choices[0].finish_reason == want["finish_reason"]
    assert r.usage.prompt_tokens == want["prompt_tokens"]
    assert r.usage.completion_tokens == len(want["token_ids"])


@pytest.mark.card(
    "P0-006",
    "streamed-outputs-over-the-typed-transport-arrive-in-order-and-equal-offline-generation",
)
def test_chat_stream_with_usage(client, model, llm_ref):
    stream = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    want = ref(llm_ref, CHAT, 20)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    body = [c for c in chunks if c.choices]
    assert body[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == want["text"]
    finals = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finals == [want["finish_reason"]] and body[-1].choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want["token_ids"])
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.card(
    "P0-006",
    "streamed-outputs-over-the-typed-transport-arrive-in-order-and-equal-offline-generation",
)
def test_completion_stream_raw_sse(server, model, llm_ref):
    """Object names, a final chunk with the finish reason, then `data: [DONE]`."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    chunks = strict_sse(events)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "usage" not in chunks[-1]
    want = ref(llm_ref, PROMPT, 10, ignore_eos=True)
    assert "".join(c["choices"][0]["text"] for c in chunks) == want["text"]


def strict_sse(lines: list[str]) -> list[dict]:
    """Parse a stream as peer clients do (SGLang's and vLLM's bench_serving, many hand-written
    ones): every non-empty line is `data: <json>`, the last one `data: [DONE]`; no comments,
    no `event:` / `id:` lines."""
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    chunks = []
    for line in lines[:-1]:
        assert line.startswith("data: "), f"not a data line: {line!r}"
        payload = line[len("data: ") :]
        assert payload != "[DONE]", "[DONE] before the end of the stream"
        chunks.append(json.loads(payload))
    return chunks


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_streams_carry_only_data_lines(server, model, endpoint):
    """Issue 41: a peer client `json.loads` every non-empty line (an SSE comment crashed
    SGLang's bench_serving on our first line)."""
    body = {"model": model, "max_tokens": 6, "temperature": 0, "stream": True}
    if endpoint == "completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = CHAT
    url = f"{server.base_url}/v1/{endpoint}"
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    chunks = strict_sse(lines)
    assert chunks and all(c["choices"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in {"length", "stop"}


def test_stop_string(client, model, llm_ref):
    full = ref(llm_ref, PROMPT, 24, ignore_eos=True)["text"]
    stop = full[6:9] if len(full) > 9 else full[-2:]
    assert stop
    r = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.find(stop)]
    s = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(s)
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_reproducible(client, model):
    kw = dict(
        model=model,
        prompt=PROMPT,
        max_tokens=16,
        temperature=1.0,
        top_p=0.9,
        extra_body={"top_k": 50, "ignore_eos": True},
    )
    a = client.completions.create(seed=3, **kw).choices[0].text
    b = client.completions.create(seed=3, **kw).choices[0].text
    assert a == b


@pytest.mark.card(
    "P0-006",
    "streamed-outputs-over-the-typed-transport-arrive-in-order-and-equal-offline-generation",
)
def test_async_client_stream_and_not(server, model, llm_ref):
    want_chat = ref(llm_ref, CHAT, 16)
    want_text = ref(llm_ref, PROMPT, 16)

    async def main():
        async with openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="x", timeout=60
        ) as c:
            r1 = await c.chat.completions.create(
                model=model, messages=CHAT, max_tokens=16, temperature=0
            )
            r2 = await c.completions.create(
                model=model, prompt=PROMPT, max_tokens=16, temperature=0
            )
            s1 = await c.chat.completions.create(
                model=model, messages=CHAT, max_tokens=16, temperature=0, stream=True
            )
            t1 = "".join([ch.choices[0].delta.content or "" async for ch in s1 if ch.choices])
            s2 = await c.completions.create(
                model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True
            )
            t2 = "".join([ch.choices[0].text async for ch in s2])
            return r1.choices[0].message.content, r2.choices[0].text, t1, t2

    chat, text, chat_s, text_s = asyncio.run(asyncio.wait_for(main(), 120))
    assert chat == chat_s == want_chat["text"]
    assert text == text_s == want_text["text"]


@pytest.mark.card(
    "P0-001", "server-metrics-exposes-queue-kv-prefix-cache-ttft-tpot-and-e2e-latency"
)
def test_metrics_exposition(server, client, model):
    client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    for name in (
        "minisgl_num_running_requests",
        "minisgl_num_queued_requests",
        "minisgl_kv_pages_used",
        "minisgl_kv_pages_total 4096",
        "minisgl_prefix_cache_hit_rate",
        "minisgl_generated_tokens_total",
        "minisgl_time_to_first_token_seconds_bucket",
        "minisgl_time_per_output_token_seconds_count",
        "minisgl_e2e_request_latency_seconds_sum",
        "minisgl_cpu_backend",
    ):
        assert name in text, name


def test_every_metric_family_has_help_and_type(server):
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    helps = set(re.findall(r"^# HELP (\S+) ", text, re.M))
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert helps == set(types)
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types, line
