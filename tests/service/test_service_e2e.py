"""P1-011 end to end: the rust_service backend answers like the python backend, through the
`openai` client, on the parity corpus (text, chat, token ids, stop strings, streaming and not,
page sizes 1 and 16, prefix hits, chunked prefill), with every KV page back after each
scenario, and the same 4xx for every bad request."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import httpx
import openai
import pytest

from minisgl.benchmark.token_parity import TEXT_PROMPTS, token_prompts
from minisgl.testing.bad_requests import CASES, POISON
from minisgl.testing.server import metric, metrics, wait_kv_clean

CARD = "P1-011"
SERVICES = ("service", "service16")
VOCAB = 384  # the tiny models' tokenizer
E2E = (
    "failing-end-to-end-tests-against-the-service-backend",
    "the-service-backend-passes-the-end-to-end-tests",
)  # Red, then Green


@dataclass(frozen=True)
class Answer:
    """What must be equal across backends for one request (greedy fp32: everything)."""

    texts: tuple[str, ...]
    finish: tuple[str | None, ...]
    prompt_tokens: int
    completion_tokens: int
    logprobs: Any = None


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=60, max_retries=0)


def model_id(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


EXTRA = {"ignore_eos", "stop_token_ids", "top_k", "min_p", "repetition_penalty", "min_tokens"}


def ask(server, kind: str, stream: bool, **kw) -> Answer:
    """One request through the openai client; a stream is joined chunk by chunk."""
    body_only = EXTRA | ({"response_format"} if kind == "completions" else set())
    extra = {k: kw.pop(k) for k in list(kw) if k in body_only}  # not in the client's signature
    if extra:
        kw["extra_body"] = extra
    c = client(server)
    model = model_id(c)
    if kind == "chat":
        call = c.chat.completions.create
    else:
        call = c.completions.create
    if not stream:
        r = call(model=model, **kw)
        if kind == "chat":
            texts = tuple(ch.message.content for ch in r.choices)
        else:
            texts = tuple(ch.text for ch in r.choices)
        lps = None
        if kind == "completions" and r.choices[0].logprobs is not None:
            lps = [(ch.logprobs.tokens, ch.logprobs.token_logprobs) for ch in r.choices]
        return Answer(
            texts,
            tuple(ch.finish_reason for ch in r.choices),
            r.usage.prompt_tokens,
            r.usage.completion_tokens,
            lps,
        )
    n = kw.get("n", 1)
    parts: list[list[str]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    usage = None
    for chunk in call(model=model, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            piece = ch.delta.content if kind == "chat" else ch.text
            parts[ch.index].append(piece or "")
            finish[ch.index] = ch.finish_reason or finish[ch.index]
    assert usage is not None, "no usage chunk"
    return Answer(
        tuple("".join(p) for p in parts),
        tuple(finish),
        usage.prompt_tokens,
        usage.completion_tokens,
    )


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colors."},
        {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "Two more, é and 中文 welcome."},
    ],
]
SHARED = list(range(5, 5 + 70))  # a 70-token prefix shared by the prefix scenario
SCENARIOS: dict[str, list[tuple[str, dict]]] = {
    "text": [
        ("completions", {"prompt": p, "max_tokens": 24, "temperature": 0}) for p in TEXT_PROMPTS[:4]
    ],
    "token-ids": [
        ("completions", {"prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        for ids in token_prompts(4, 8, 120, VOCAB, seed=0)
    ],
    "chat": [("chat", {"messages": m, "max_tokens": 24, "temperature": 0}) for m in CHATS],
    "stop-strings": [
        ("completions", {"prompt": p, "max_tokens": 40, "temperature": 0, "stop": s})
        for p in TEXT_PROMPTS[:3]
        for s in (["e"], [" t", "a"], ["\n"])
    ],
    "stop-token-ids": [
        (
            "completions",
            {"prompt": "one two", "max_tokens": 30, "temperature": 0, "stop_token_ids": [t]},
        )
        for t in range(40, 48)
    ],
    "prefix-hits": [
        ("completions", {"prompt": [*SHARED, 100 + i], "max_tokens": 8, "temperature": 0})
        for i in range(4)
    ],
    "seeded-sampling": [
        (
            "completions",
            {"prompt": "abc", "max_tokens": 12, "temperature": 0.9, "seed": 7, "n": 2},
        ),
        (
            "completions",
            {
                "prompt": "xyz",
                "max_tokens": 12,
                "temperature": 0.7,
                "top_p": 0.8,
                "seed": 3,
                "presence_penalty": 0.5,
            },
        ),
    ],
    "logprobs": [
        ("completions", {"prompt": "hello", "max_tokens": 6, "temperature": 0, "logprobs": 2})
    ],
    "structured": [  # issue 38: the grammar's masks on the worker, whichever control plane
        (
            kind,
            {
                **({"prompt": "Answer:"} if kind == "completions" else {"messages": CHATS[0]}),
                "max_tokens": 32,
                "temperature": 0.8,
                "seed": 5,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "out",
                        "schema": {
                            "type": "object",
                            "properties": {"pick": {"enum": ["a", "b", "c"]}},
                            "required": ["pick"],
                            "additionalProperties": False,
                        },
                    },
                },
            },
        )
        for kind in ("completions", "chat")
    ],
}


@pytest.mark.card(CARD, *E2E, "greedy-token-parity-with-the-python-backend-on-the-parity-corpus")
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_service_answers_like_python(servers, scenario, stream):
    py = servers["python"].get()
    for name in SERVICES:
        svc = servers[name].get()
        for kind, kw in SCENARIOS[scenario]:
            if stream and "logprobs" in kw:
                continue  # logprobs are compared on whole responses
            want = ask(py, kind, stream, **dict(kw))
            got = ask(svc, kind, stream, **dict(kw))
            if "stop" in kw:  # the python detokenizer counts every token of the steps it
                # merged into one update, even past the stop string (timing-dependent); the
                # service counts up to the stop token: never more
                assert got.completion_tokens <= want.completion_tokens, (name, kw)
                got = replace(got, completion_tokens=want.completion_tokens)
            assert replace(got, logprobs=None) == replace(want, logprobs=None), (name, kw)
            if want.logprobs is not None:  # same tokens; values equal up to fp32 rounding
                assert got.logprobs is not None, (name, kw)  # (chunking changes the sum order)
                for (gt, gv), (wt, wv) in zip(got.logprobs, want.logprobs, strict=True):
                    assert gt == wt and gv == pytest.approx(wv, abs=1e-4), (name, kw)
        wait_kv_clean(svc)  # every page back (or in the prefix cache), integrity check passed


@pytest.mark.card(
    CARD, *E2E, "request-ingress-queueing-admission-radix-cache-step-plans-finish-rules"
)
def test_prefix_cache_hits_and_chunked_prefill(servers):
    for name in SERVICES:
        svc = servers[name].get()
        before = metric(metrics(svc), "minisgl_cached_prompt_tokens_total")
        steps0 = metric(metrics(svc), "minisgl_scheduler_steps_total")
        prompt = SHARED + list(range(200, 260))  # 131 tokens: > 4 chunks of 32 on service16
        for tail in range(3):
            r = client(svc).completions.create(
                model=model_id(client(svc)), prompt=[*prompt, tail], max_tokens=1, temperature=0
            )
            assert r.usage.prompt_tokens == len(prompt) + 1
        text = wait_kv_clean(svc)
        hit = metric(text, "minisgl_cached_prompt_tokens_total") - before
        page = 16 if name == "service16" else 1
        assert hit >= 2 * (len(prompt) // page * page) - 2 * page, (name, hit)
        steps = metric(text, "minisgl_scheduler_steps_total") - steps0
        if name == "service16":  # the first prompt alone needs ceil(132 / 32) prefill steps
            assert steps >= 5, steps


@pytest.mark.card(CARD, *E2E, "every-bad-input-case-gets-the-same-4xx-from-the-service-path")
def test_bad_input_same_4xx(servers):
    py, svc = servers["python"].get(), servers["service"].get()
    bodies = [(e, b, None) for e, b, *_ in CASES] + [(e, None, raw) for e, raw, _ in POISON]
    bodies.append(("completions", {"prompt": ""}, None))
    a = httpx.Client(base_url=py.base_url, timeout=60)
    b = httpx.Client(base_url=svc.base_url, timeout=60)
    with a, b:
        for endpoint, body, raw in bodies:
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            kw = {"json": body} if raw is None else {"content": raw}
            ra, rb = a.post(path, **kw), b.post(path, **kw)
            assert rb.status_code == ra.status_code, (body or raw, rb.text)
            assert 400 <= rb.status_code < 500
            ea, eb = ra.json()["error"], rb.json()["error"]
            assert (eb["param"], eb["code"], eb["type"]) == (ea["param"], ea["code"],
                                                             ea["type"]), (body, eb)  # fmt: skip
        assert b.get("/health").json()["in_flight"] == 0
    wait_kv_clean(svc)


@pytest.mark.card(CARD, "backend-selected-with-minisgl-cpu-backend")
def test_backend_reported_in_health(servers):
    assert httpx.get(servers["python"].get().base_url + "/health").json()["cpu_backend"] == (
        "python"
    )
    h = httpx.get(servers["service"].get().base_url + "/health").json()
    assert h["cpu_backend"] == "rust_service"
    assert set(h["workers"]) == {"service", "worker0"}


@pytest.mark.card(CARD, "health-readiness-and-prometheus-counters")
@pytest.mark.card(CARD, "one-step-in-flight-ahead-pages-freed-only-after-confirmation")
def test_service_counters_in_metrics(servers):
    svc = servers["service"].get()
    h = httpx.get(svc.base_url + "/health").json()  # ready: answered only after the handshake
    assert h["status"] == "ok" and h["cpu_backend"] == "rust_service"
    before = metric(metrics(svc), "minisgl_cpu_backend", '{path="service.steps"}')
    c = client(svc)
    r = c.completions.create(model=model_id(c), prompt="one two three", max_tokens=12,
                             temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert r.usage.completion_tokens == 12
    text = wait_kv_clean(svc)
    assert 'minisgl_cpu_backend_info{backend="rust_service"} 1' in text
    steps = metric(text, "minisgl_cpu_backend", '{path="service.steps"}') - before
    assert steps >= 12  # one prefill + 11 decodes at least (a step ahead may be wasted)
    assert metric(text, "minisgl_cpu_backend", '{path="service.max_steps_in_flight"}') == 2
    assert metric(text, "minisgl_cpu_backend", '{path="service.steps_in_flight"}') == 0
    assert metric(text, "minisgl_cpu_backend", '{path="service.tokens"}') >= 12
    for name in ("ingress_us", "schedule_us", "commit_us", "requests", "rejected_frames"):
        metric(text, "minisgl_cpu_backend", f'{{path="service.{name}"}}')
    assert metric(text, "minisgl_scheduler_steps_total") >= steps


def test_release_gate_python_vs_rust_service(servers, tiny_llama, tmp_path):
    """The cutover's flow in small: the online harness writes observations against each
    backend's server, the release gate joins them by request id: promote on identical
    outputs; a tampered candidate output rolls back (exit 2)."""
    import json

    from minisgl.benchmark import harness, release_gate
    from minisgl.benchmark.observations import read_jsonl

    small = ["--set", "num_requests=8", "--set", "output_len=6", "--set", "input_len_min=8",
             "--set", "input_len_max=24", "--set", "warmup_requests=1", "--no-progress"]  # fmt: skip
    files = {}
    for name in ("python", "service"):
        files[name] = tmp_path / f"obs.{name}.jsonl"
        rc = harness.main(
            ["online", "--base-url", servers[name].get().base_url, "--model-path",
             str(tiny_llama), "--observations", str(files[name]), *small]
        )  # fmt: skip
        assert rc == 0, name
    assert {o.backend for o in read_jsonl(files["service"])} == {"rust_service"}
    policy = tmp_path / "p.yaml"  # outputs and errors only: latency on a shared box is noise
    policy.write_text(
        "version: 1\nevidence: {min_matched_requests: 8, min_match_fraction: 1.0}\n"
        "latency: {e2e: {max_ratio: null}, ttft: {max_ratio: null}, itl: {max_ratio: null},"
        " tpot: {max_ratio: null}}\n"
        "kv_pressure: {peak: {max_ratio: null}, p95: {max_ratio: null}}\n"
    )
    out = tmp_path / "r.json"
    argv = ["--baseline", str(files["python"]), "--candidate", str(files["service"]),
            "--policy", str(policy), "--out", str(out), "--quiet"]  # fmt: skip
    assert release_gate.main(argv) == 0, json.loads(out.read_text())["reasons"]
    report = json.loads(out.read_text())
    assert report["counts"]["matched"] == 8
    assert report["segments"][0]["summary"]["outputs"]["compared"] == 8
    rows = [json.loads(line) for line in files["service"].read_text().splitlines()]
    rows[5]["output_text"] = rows[5]["output_text"][:3] + "#" + rows[5]["output_text"][4:]
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv[3] = str(tampered)
    assert release_gate.main(argv) == 2
    (item,) = json.loads(out.read_text())["triage"]
    assert item["signal"] == "output_mismatch" and item["examples"][0]["first_divergence"] == 3


@pytest.mark.parametrize("name", ["python", "service"])
def test_engine_warmed_up_before_health(servers, name):
    """Issue 39: /health answers 200 only after the engine's warm-up (a few prefill shapes, a
    prefix extend, decodes of a few batch sizes) ran, every page of it returned."""
    srv = servers[name].get()
    h = httpx.get(srv.base_url + "/health").json()
    assert h["status"] == "ok"
    w = h["warmup"]
    assert w["kind"] == "shapes" and w["steps"] > 0 and w["leaked_pages"] == 0
    assert 1 in w["prefill_lengths"] and w["decode_batches"][0] == 1
    text = metrics(srv)
    assert metric(text, "minisgl_warmup_steps") == w["steps"]
    assert metric(text, "minisgl_warmup_requests") == w["requests"]
    assert metric(text, "minisgl_warmup_seconds") == pytest.approx(w["seconds"])
