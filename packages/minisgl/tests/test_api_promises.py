"""Issue 60 item 2, the documented promises as properties, checked on every path: hypothesis
draws requests (temperature, top_k, top_p, max_tokens, n, seed, stop strings, a json_schema
whose properties come in a drawn order, tools) and batches of them, and each promise is checked
on the offline `LLM` and the server, each on the python and the rust_service control plane,
with overlap scheduling on and off (`MINISGL_DISABLE_OVERLAP_SCHEDULING=1` / `overlap=False`):

* usage: `prompt_tokens` is the tokenizer's count of the prompt, `completion_tokens` the
  tokens the choices returned (`docs/server.md`, "API");
* `finish_reason`: "length" exactly when max_tokens tokens came and no stop (EOS, stop token,
  stop string) ended the choice, else "stop"; the text holds no stop string (it is cut before);
* `n`: n choices; seeded and sampled, choice i draws as a request with seed + i would (exact
  where the logits do not depend on the batch: `deterministic=True`), so the choices differ;
* `response_format` json_schema: a finished output parses, validates and keeps the schema's
  property order; `tools` with `tool_choice: required`: calls of the listed functions with
  JSON-object arguments, `finish_reason: tool_calls` (the server only: `LLM` has no tools);
* bad parameters: offline a ValueError / RequestError, the server a 400 naming the parameter,
  and both accept and refuse the same requests.

A tiny random llama (the tool tests' chat template, 512 positions); every engine and server
is started once for the module and shared by the examples.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from minisgl import LLM, SamplingParams
from minisgl.scheduler.request import RequestError
from minisgl.testing.server import running_server
from minisgl.testing.tiny_models import write_tiny_model

CTX = 512
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} "
    "{% endfor %}<tool_call></tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
OVERLAP_OFF = {"MINISGL_DISABLE_OVERLAP_SCHEDULING": "1"}
OFFLINE = [("python", True), ("python", False), ("rust_service", True), ("rust_service", False)]
SERVERS = [("python", True), ("python", False), ("rust_service", True), ("rust_service", False)]
# examples per property (each runs on all 8 paths): the file in ~60 s on 2 idle cores, most of
# it the 4 servers' start-up
EXAMPLES = {"promises": 5, "refusals": 10, "seeds": 10}


def budget(kind: str) -> settings:
    return settings(
        max_examples=EXAMPLES[kind],
        deadline=None,
        derandomize=True,  # the same examples every run: a time budget, no flaky draws
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


# ------------------------------------------------------------------ the paths
@dataclass
class Choice:
    text: str | None
    tokens: int  # the tokens this choice returned
    finish_reason: str
    token_ids: list[int] | None = None  # offline only
    tool_calls: list[dict] | None = None


@dataclass
class Result:
    """One request's answer on one path: its choices and usage, or why it was refused."""

    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    refused: str | None = None  # offline: the exception's type; server: the 400's param


def body_of(req: dict) -> dict:
    """The request as the server takes it (chat or completions)."""
    body = {k: v for k, v in req.items() if k not in ("prompt", "messages") and v is not None}
    body["prompt" if "prompt" in req else "messages"] = req.get("prompt", req.get("messages"))
    return body


class Offline:
    def __init__(self, model, backend: str, overlap: bool) -> None:
        self.name = f"offline-{backend}-{'overlap' if overlap else 'serial'}"
        self.llm = LLM(
            model, num_pages=4096, max_seq_len_override=CTX, cpu_backend=backend, overlap=overlap
        )

    def run(self, reqs: list[dict]) -> list[Result]:
        """The requests in one `generate` call (one batch); a refused one alone."""
        prompts, params = [], []
        for req in reqs:
            kw = {k: v for k, v in req.items() if k not in ("prompt", "messages", "tools")}
            kw.pop("tool_choice", None)
            kw.setdefault("max_tokens", 16)  # the completions endpoint's default
            prompts.append(req.get("prompt", req.get("messages")))
            try:
                params.append(SamplingParams(**kw))
            except (ValueError, RequestError) as e:
                assert len(reqs) == 1, f"{self.name}: {req} refused in a batch: {e}"
                return [Result([], 0, 0, refused=type(e).__name__)]
        try:
            outs = self.llm.generate(prompts, params)
        except (ValueError, RequestError) as e:
            assert len(reqs) == 1, f"{self.name}: a batch was refused: {e}"
            return [Result([], 0, 0, refused=type(e).__name__)]
        results = []
        for req, o in zip(reqs, outs, strict=True):
            assert o.get("error") is None, (self.name, req, o["error"])
            choices = [
                Choice(s["text"], len(s["token_ids"]), s["finish_reason"], s["token_ids"])
                for s in o["outputs"]
            ]
            results.append(Result(choices, o["prompt_tokens"], sum(c.tokens for c in choices)))
        return results

    def close(self) -> None:
        self.llm.close()


class Server:
    def __init__(self, backend: str, overlap: bool, handle) -> None:
        self.name = f"server-{backend}-{'overlap' if overlap else 'serial'}"
        self.handle = handle

    def run(self, reqs: list[dict]) -> list[Result]:
        async def one(c: httpx.AsyncClient, req: dict) -> Result:
            body = body_of(req)
            chat = "messages" in body
            if "logprobs" not in body:  # to count each choice's tokens
                body.update({"logprobs": True, "top_logprobs": 0} if chat else {"logprobs": 0})
            r = await c.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
            if r.status_code != 200:
                assert r.status_code == 400, (self.name, req, r.status_code, r.text)
                err = r.json()["error"]
                assert err["param"], (self.name, req, err)
                return Result([], 0, 0, refused=err["param"])
            data = r.json()
            choices = []
            for ch in sorted(data["choices"], key=lambda ch: ch["index"]):
                lp = ch["logprobs"]
                if chat:
                    msg = ch["message"]
                    n = len(lp["content"] or []) if lp else 0
                    choices.append(Choice(msg["content"], n, ch["finish_reason"],
                                          tool_calls=msg.get("tool_calls")))  # fmt: skip
                else:
                    choices.append(Choice(ch["text"], len(lp["tokens"]), ch["finish_reason"]))
            u = data["usage"]
            assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
            return Result(choices, u["prompt_tokens"], u["completion_tokens"])

        async def main() -> list[Result]:
            async with httpx.AsyncClient(base_url=self.handle.base_url, timeout=120) as c:
                return list(await asyncio.gather(*(one(c, r) for r in reqs)))

        return asyncio.run(main())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    path = write_tiny_model("llama", tmp_path_factory.mktemp("promises-llama"), seed=0)
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def paths(model, tmp_path_factory):
    """The 8 paths; the servers start together (in threads) while the engines load."""
    log_dir = tmp_path_factory.mktemp("promises-log")
    with contextlib.ExitStack() as stack:
        cms = [
            running_server(
                model,
                "--max-seq-len-override",
                str(CTX),
                log_dir=log_dir,
                env={"MINISGL_CPU_BACKEND": b, **({} if on else OVERLAP_OFF)},
            )
            for b, on in SERVERS
        ]
        with ThreadPoolExecutor(len(cms)) as pool:
            started = [pool.submit(cm.__enter__) for cm in cms]
            offline = []
            for b, on in OFFLINE:
                offline.append(Offline(model, b, on))
                stack.callback(offline[-1].close)
            for cm, fut in zip(cms, started, strict=True):
                with contextlib.suppress(Exception):
                    fut.result()
                    stack.push(cm.__exit__)
            handles = [f.result() for f in started]  # raises after the others are registered
        for (b, on), h in zip(SERVERS, handles, strict=True):
            if b == "rust_service":  # the switch reaches the service: one step ahead or none
                assert f"depth {2 if on else 1}" in h.log(), h.log()
        yield [*offline, *(Server(b, on, h) for (b, on), h in zip(SERVERS, handles, strict=True))]


@pytest.fixture(scope="module")
def tokenizer(paths):
    return paths[0].llm.tokenizer


def run_everywhere(paths: list, batch: list[dict]) -> list[tuple[Any, list[dict], list[Result]]]:
    """The batch on every path (tools on the servers only): the servers' requests in threads,
    beside the offline engines' runs in this one."""
    servers = [p for p in paths if isinstance(p, Server)]
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [(path, batch, pool.submit(path.run, batch)) for path in servers]
        plain = [r for r in batch if not r.get("tools")]
        done = [(path, plain, path.run(plain)) for path in paths if plain and path not in servers]
        return done + [(path, reqs, fut.result()) for path, reqs, fut in futures]


# ------------------------------------------------------------------ strategies
WORDS = st.sampled_from(["the", "a", "cat", "sat", "on", "mat", "hello", "world", "42", "é"])
TEXT = st.lists(WORDS, min_size=1, max_size=12).map(" ".join)
STOPS = st.sampled_from(["e", "a", "t", " ", "o", "in", "\n", "th"])
TOOL_FNS = ["f", "g", "h"]


@st.composite
def sampling(draw) -> dict:
    kw: dict[str, Any] = {
        "temperature": draw(st.sampled_from([0.0, 0.5, 1.0, 1.7])),
        "max_tokens": draw(st.integers(1, 24)),
        "n": draw(st.integers(1, 3)),
    }
    if draw(st.booleans()):
        kw["top_k"] = draw(st.sampled_from([-1, 0, 1, 5, 40]))
    if draw(st.booleans()):
        kw["top_p"] = draw(st.sampled_from([0.3, 0.9, 1.0]))
    if draw(st.booleans()):
        kw["seed"] = draw(st.integers(0, 2**63 - 1))
    if draw(st.booleans()):
        kw["stop"] = draw(st.lists(STOPS, min_size=1, max_size=3, unique=True))
    kw["ignore_eos"] = draw(st.booleans())
    return kw


@st.composite
def schemas(draw) -> dict:
    names = draw(st.lists(st.sampled_from(["zebra", "apple", "mango", "kiwi", "b", "a"]),
                          min_size=1, max_size=3, unique=True))  # fmt: skip
    kinds = [{"type": "boolean"}, {"enum": ["x", "y", "z"]}, {"type": "null"},
             {"type": "integer", "minimum": 0, "maximum": 9}]  # fmt: skip
    props = {n: draw(st.sampled_from(kinds)) for n in names}  # insertion order: the drawn one
    return {"type": "object", "properties": props, "required": names,
            "additionalProperties": False}  # fmt: skip


@st.composite
def requests(draw) -> dict:
    kw = draw(sampling())
    if draw(st.booleans()):
        req = {"prompt": draw(TEXT)}
    else:
        req = {"messages": [{"role": "user", "content": draw(TEXT)}]}
    kind = draw(st.sampled_from(["plain", "plain", "plain", "json_schema", "tools"]))
    if kind == "json_schema":
        schema = draw(schemas())
        fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
        kw.update(response_format=fmt, ignore_eos=False, max_tokens=64)
        kw.pop("stop", None)
    elif kind == "tools" and "messages" in req:
        names = draw(st.lists(st.sampled_from(TOOL_FNS), min_size=1, max_size=2, unique=True))
        params = {"type": "object", "properties": {}, "additionalProperties": False}
        req["tools"] = [{"type": "function", "function": {"name": n, "parameters": params}}
                        for n in names]  # fmt: skip
        req["tool_choice"] = "required"
        kw.update(ignore_eos=False, max_tokens=64)
        kw.pop("stop", None)
    return {**req, **kw}


# ------------------------------------------------------------------ the promises
def prompt_count(tokenizer, req: dict) -> int:
    if "prompt" in req:
        return len(tokenizer(req["prompt"])["input_ids"])
    ids = tokenizer.apply_chat_template(
        req["messages"], tools=req.get("tools"), add_generation_prompt=True, tokenize=True
    )
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def check_promises(path, req: dict, res: Result, tokenizer, eos: set[int]) -> None:
    where = f"{path.name}: {req!r}"
    assert res.refused is None, f"{where}: refused ({res.refused})"
    n = req.get("n", 1)
    assert len(res.choices) == n, where
    assert res.prompt_tokens == prompt_count(tokenizer, req), where
    assert res.completion_tokens == sum(c.tokens for c in res.choices), where
    max_tokens = req["max_tokens"]
    stops = req.get("stop") or []
    for c in res.choices:
        if req.get("tools"):
            assert c.finish_reason in ("tool_calls", "length"), f"{where}: {c}"
            if c.finish_reason == "tool_calls":
                assert c.tool_calls, f"{where}: {c}"
                for call in c.tool_calls:
                    assert call["function"]["name"] in {t["function"]["name"]
                                                        for t in req["tools"]}, f"{where}: {c}"  # fmt: skip
                    assert isinstance(json.loads(call["function"]["arguments"]), dict), (
                        f"{where}: {c}"
                    )
            continue
        assert c.finish_reason in ("stop", "length"), f"{where}: {c}"
        assert 1 <= c.tokens <= max_tokens, f"{where}: {c}"
        assert not any(s in c.text for s in stops), f"{where}: {c}"  # cut before the stop string
        if c.finish_reason == "length":
            assert c.tokens == max_tokens, f"{where}: {c}"
            if c.token_ids is not None:
                assert c.token_ids[-1] not in eos or req.get("ignore_eos"), f"{where}: {c}"
        elif c.tokens == max_tokens and c.token_ids is not None:
            # "stop" at max_tokens: the last token was EOS, or a stop string cut the text
            full = tokenizer.decode(c.token_ids)
            hit = c.token_ids[-1] in eos and not req.get("ignore_eos")
            assert hit or any(s in full for s in stops), f"{where}: {c} {full!r}"
        elif req.get("ignore_eos") and not stops and c.token_ids is not None:
            raise AssertionError(f"{where}: 'stop' with ignore_eos, no stop and {c}")
        fmt = req.get("response_format")
        if fmt and c.finish_reason == "stop":
            schema = fmt["json_schema"]["schema"]
            value = json.loads(c.text)
            assert list(value) == list(schema["properties"]), f"{where}: {c.text!r}"
    # 384 tokens of a random model: seed, seed + 1, ... draw different choices
    wide = req.get("top_p", 1.0) >= 0.9 and req.get("top_k", -1) in (-1, 0, 40)
    free = req.get("ignore_eos") and not stops and max_tokens >= 6
    if n > 1 and req["temperature"] > 0 and wide and free:
        texts = [c.token_ids or c.text for c in res.choices]
        assert len({json.dumps(t) for t in texts}) == n, f"{where}: {res.choices}"


# the offline API kept a stop string completed by the max_tokens-th token ("...it", "length")
LAST_TOKEN_STOP = {"prompt": "the 42", "temperature": 0.5, "max_tokens": 15, "seed": 10,
                   "stop": ["t"], "n": 1}  # fmt: skip


@given(batch=st.lists(requests(), min_size=1, max_size=4))
@example(batch=[LAST_TOKEN_STOP])
@budget("promises")
def test_promises_hold_on_every_path(paths, tokenizer, batch):
    eos = set(paths[0].llm.eos_token_ids)
    for path, reqs, results in run_everywhere(paths, batch):
        for req, res in zip(reqs, results, strict=True):
            check_promises(path, req, res, tokenizer, eos)


# ------------------------------------------------------------------ bad parameters
BAD = {
    "temperature": [-0.5, 0.0, 2.0, 2.5, 7, "hot"],
    "top_p": [0, 0.5, 1.0, 1.5, -1],
    "top_k": [-3, -1, 0, 1, 1000, 1.5],
    "max_tokens": [-1, 0, 1, CTX, CTX + 1, "10"],
    "n": [0, 1, 2, 129, 2.0],
    "seed": [-1, 0, 2**63 - 1, 2**63, "x"],
    "stop": [[""], ["a"], ["x"] * 16, ["x"] * 17, 5, [5]],
    "min_p": [-0.1, 0.0, 1.0, 1.5],
    "presence_penalty": [-2.5, -2, 2, 2.5],
    "repetition_penalty": [0, 0.5, 2, 2.1],
    "min_tokens": [-1, 0, 2, 3],
    "logprobs": [-1, 0, 20, 21, True],
    "logit_bias": [{"5": 100}, {"5": 101}, {"99999": 1}],
    "response_format": [{"type": "bogus"}, {"type": "json_schema"}, {"type": "json_object"}],
    "stop_token_ids": [[5], [-1], ["x"]],
    "prompt": ["", [1, 2], [1, 10**6], [-1], "x " * 600],
}


def offline_kw(name: str, value: Any) -> tuple[str, Any]:
    """The offline spelling of a server parameter (`logit_bias` keys are ints offline)."""
    if name == "logit_bias" and isinstance(value, dict):
        return name, {int(k): v for k, v in value.items()}
    return name, value


@st.composite
def bad_requests(draw) -> dict:
    """One to three of the parameters above, each a value in or out of its range."""
    names = draw(st.lists(st.sampled_from(sorted(BAD)), min_size=1, max_size=3, unique=True))
    return {name: draw(st.sampled_from(BAD[name])) for name in names}


@given(params=bad_requests())
@example(params={"temperature": 2.5})  # the server's bounds, refused offline too (issue 60)
@example(params={"top_k": -3})
@example(params={"n": 129})
@example(params={"seed": -1})
@example(params={"seed": 2**63})
@example(params={"stop": ["x"] * 17})
@budget("refusals")
def test_offline_and_server_refuse_the_same_requests(paths, params):
    req: dict[str, Any] = {"prompt": "hi", "max_tokens": 2, **params}
    off = dict(offline_kw(k, v) for k, v in req.items())
    verdicts = {}
    for path in paths:
        if isinstance(path, Server):
            res = path.run([req])[0]
            if res.refused is not None:
                assert res.refused in params, f"{path.name}: {params!r} refused as {res.refused}"
        else:
            res = path.run([off])[0]
        verdicts[path.name] = res.refused
    refused = {name: v is not None for name, v in verdicts.items()}
    assert len(set(refused.values())) == 1, f"{params!r}: refused? {verdicts}"


SEEDED = st.fixed_dictionaries(
    {
        "prompt": TEXT,
        "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.7]),
        "max_tokens": st.integers(2, 12),
        "n": st.integers(2, 4),
        "seed": st.integers(0, 2**63 - 1),
        "ignore_eos": st.just(True),
    }
)


@pytest.fixture(scope="module", params=["python", "rust_service"])
def deterministic(model, request):
    """Batch-invariant logits (`deterministic=True`, bf16), on either control plane."""
    try:
        llm = LLM(model, num_pages=4096, max_seq_len_override=CTX, dtype="bfloat16",
                  deterministic=True, cpu_backend=request.param)  # fmt: skip
    except ValueError as e:  # no native bf16 or no C compiler here: the mode is refused
        pytest.skip(f"deterministic mode refused on this machine: {e}")
    yield llm
    llm.close()


@given(req=SEEDED)
@example(req={"prompt": "hi", "temperature": 1.0, "max_tokens": 4, "n": 3, "seed": 2**63 - 2,
              "ignore_eos": True})  # fmt: skip
@budget("seeds")
def test_choice_i_samples_as_seed_plus_i(deterministic, req):
    """`n`: choice i has seed `seed + i` (mod 2**63), so it draws the tokens a request with that
    seed draws: exact where the logits do not depend on the batch (deterministic mode); sampled
    choices differ, greedy ones are identical and equal n = 1 (docs/server.md)."""
    kw = {k: v for k, v in req.items() if k != "prompt"}
    many = deterministic.generate(req["prompt"], SamplingParams(**kw))[0]["outputs"]
    n, seed = kw.pop("n"), kw.pop("seed")
    each = deterministic.generate(
        [req["prompt"]] * n, [SamplingParams(**kw, seed=(seed + i) % 2**63) for i in range(n)]
    )
    assert [c["token_ids"] for c in many] == [a["token_ids"] for a in each]
    distinct = len({tuple(c["token_ids"]) for c in many})
    assert distinct == (n if req["temperature"] > 0 else 1), many
