"""Issue 37, item 2's last sentence ("The release gate's per-replica segments show the split"):
which replica served each request travels from the engine that admitted it (`Admitted`, both
codecs, the Rust service too) to the client (a `minisgl` object in the body and in the stream's
last chunks, an `X-Minisgl-Replica` header; nothing at dp=1), into the benchmark's observations,
and the release gate judges each replica as its own segment beside the whole candidate."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import inspect
import json
import random
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest

from minisgl.benchmark import harness, release_gate
from minisgl.benchmark.observations import Observation, ObservationError, parse_jsonl, read_jsonl
from minisgl.benchmark.release_policy import Policy, Thresholds
from minisgl.benchmark.release_signals import evaluate, triage
from minisgl.message.schema import SCHEMA_VERSION, Admitted, Codec
from minisgl.testing.scenarios import random_prompts
from minisgl.testing.server import metric, metrics, start

sys.path.insert(0, str(Path(__file__).parent / "server"))
from test_openai_api import strict_sse  # the peer clients' strict SSE parser

CARD = "P4-005"
RED = "replica-segment-tests-fail-before-replicas-are-reported"
GREEN = "replica-segment-tests-pass"
NEW = 4
DP2 = ("--dp", "2", "--threads", "1", "--served-model-name", "m")
DP1 = ("--threads", "1", "--served-model-name", "m")
HEADER = "x-minisgl-replica"
POLICY = Policy(Thresholds(min_matched_requests=5, min_match_fraction=0.9))


# --------------------------------------------------------------------------- the message
@pytest.mark.card(
    CARD, "the-admitted-message-carries-each-request-s-replica-through-both-codecs", RED, GREEN
)
def test_admitted_carries_the_replica_through_both_codecs():
    names = [f.name for f in dataclasses.fields(Admitted)]
    assert names == ["uids", "replicas"], f"Admitted carries no replica: {names}"
    msg = Admitted(np.array([3, 9, 2**40], dtype=np.int64), np.array([1, 0, 1], dtype=np.int32))
    for typed in (True, False):
        back = Codec.decode(Codec(typed).encode(msg))
        assert isinstance(back, Admitted)
        assert back.uids.tolist() == [3, 9, 2**40] and back.replicas.tolist() == [1, 0, 1]
    raw = msgpack.unpackb(Codec(True).encode(msg))
    assert raw[:2] == [SCHEMA_VERSION, Admitted.TAG] and len(raw) == 4
    assert raw[3] == np.array([1, 0, 1], dtype="<i4").tobytes()  # raw bytes, as the Rust side
    # a sender that does not say (no replicas): an empty column, never a guess
    plain = Codec.decode(Codec(True).encode(Admitted(np.array([4], dtype=np.int64))))
    assert plain.replicas.tolist() == []


# --------------------------------------------------------------------------- the servers
@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """dp=2 on both backends and dp=1 (python) on the tiny llama; a server that does not start
    is recorded, so the tests that need it fail by assertion."""
    log_dir = tmp_path_factory.mktemp("replica-logs")
    path = tiny_model_dir("llama")
    with contextlib.ExitStack() as stack:
        yield {
            "dp2-python": stack.enter_context(
                start("dp2-python", path, *DP2, log_dir=log_dir, backend="python")
            ),
            "dp2-rust_service": stack.enter_context(
                start("dp2-rust_service", path, *DP2, log_dir=log_dir, backend="rust_service")
            ),
            "dp1-python": stack.enter_context(
                start("dp1-python", path, *DP1, log_dir=log_dir, backend="python")
            ),
        }


def routed(server) -> list[float]:
    text = metrics(server)
    return [metric(text, "minisgl_replica_requests_routed_total", f'{{replica="{i}"}}')
            for i in (0, 1)]  # fmt: skip


def settled_routed(server, before: list[float], sent: int, timeout: float = 15.0) -> list[int]:
    """Requests routed to each replica since `before`, once every one of `sent` is counted
    (rust_service: the service's stats come every 0.1-1 s)."""
    deadline = time.monotonic() + timeout
    while True:
        delta = [int(a - b) for a, b in zip(routed(server), before, strict=True)]
        if sum(delta) >= sent or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


def body_of(i: int, prompt: list[int]) -> dict:
    """Request i: completions / chat, not streamed / streamed with usage, in turn."""
    body = {"model": "m", "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    if i % 2 == 0:
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": f"request {i}: {prompt[:6]}"}]
    if (i // 2) % 2 == 1:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def ask(server, i: int, prompt: list[int]) -> dict:
    """One request: its status, header, what its body says (`minisgl` of the body, or of the
    stream's finish and usage chunks) and whether other stream chunks carry it."""
    body = body_of(i, prompt)
    url = server.base_url + ("/v1/completions" if i % 2 == 0 else "/v1/chat/completions")
    if not body.get("stream"):
        r = httpx.post(url, json=body, timeout=120)
        return {"status": r.status_code, "header": r.headers.get(HEADER),
                "said": [r.json().get("minisgl")], "others": [], "stream": False}  # fmt: skip
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    chunks = strict_sse(lines)  # only `data: {json}` lines, then `data: [DONE]`
    last = [c for c in chunks
            if c.get("usage") or any(ch.get("finish_reason") for ch in c["choices"])]  # fmt: skip
    others = [c for c in chunks if c not in last]
    return {"status": r.status_code, "header": r.headers.get(HEADER),
            "said": [c.get("minisgl") for c in last], "others": others, "stream": True}  # fmt: skip


@pytest.mark.card(
    CARD,
    "with-dp-2-the-body-the-stream-s-last-chunks-and-a-header-name-the-replica-and-the-split-"
    "matches-the-server-s-routed-counts",
    RED,
    GREEN,
)
@pytest.mark.parametrize("backend", ["python", "rust_service"])
def test_dp2_responses_name_their_replica(servers, backend):
    server = servers[f"dp2-{backend}"].get()
    prompts = random_prompts(8, 6, 30, seed=11)
    before = routed(server)
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda a: ask(server, *a), enumerate(prompts)))
    assert [r["status"] for r in replies] == [200] * len(prompts)
    assert {r["stream"] for r in replies} == {True, False}
    served = []
    for r in replies:
        assert r["header"] in ("0", "1"), f"no {HEADER} header: {r}"
        k = int(r["header"])
        assert r["said"] and all(s == {"replica": k, "replicas": 2} for s in r["said"]), r
        assert all("minisgl" not in c for c in r["others"]), "only the last chunks carry it"
        served.append(k)
    split = Counter(served)
    delta = settled_routed(server, before, len(prompts))
    assert delta == [split[0], split[1]], (delta, served)
    assert min(delta) > 0, f"one replica took everything: {served}"
    health = httpx.get(server.base_url + "/health", timeout=10).json()
    assert sum(e["routed"] for e in health["replicas"]) >= len(prompts)


@pytest.mark.card(
    CARD, "with-dp-1-responses-carry-no-replica-and-streams-stay-data-lines-only", RED, GREEN
)
def test_dp1_responses_carry_no_replica(servers):
    server = servers["dp1-python"].get()
    prompts = random_prompts(4, 6, 30, seed=12)
    replies = [ask(server, i, p) for i, p in enumerate(prompts)]
    assert [r["status"] for r in replies] == [200] * 4
    for r in replies:
        assert r["header"] is None and r["said"] and all(s is None for s in r["said"]), r
        assert all("minisgl" not in c for c in r["others"])
    # a dp=2 stream is as strict: only `data:` lines (`ask` parsed each with strict_sse)
    dp2 = servers["dp2-python"].get()
    streamed = [ask(dp2, i, p) for i, p in enumerate(prompts) if (i // 2) % 2 == 1]
    assert streamed and all(r["stream"] and r["status"] == 200 for r in streamed)
    assert all(r["said"][-1] and r["said"][-1]["replicas"] == 2 for r in streamed), streamed


# --------------------------------------------------------------------------- the clients
SMALL = ["--set", "num_requests=6", "--set", "output_len=4", "--set", "input_len_min=8",
         "--set", "input_len_max=40", "--set", "warmup_requests=0", "--no-progress"]  # fmt: skip


def observed(server, model_dir, out: Path) -> list[Observation]:
    rc = harness.main(
        ["online", "--base-url", server.base_url, "--model-path", str(model_dir),
         "--out", str(out.with_suffix(".json")), "--observations", str(out), *SMALL]
    )  # fmt: skip
    assert rc == 0
    return read_jsonl(out)


async def chat_twice(kind, base_url: str, served_cls) -> list:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi there"}],
            "max_tokens": 3, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    out = []
    async with kind(base_url, "x", 60) as client:
        for _ in range(2):  # one after the other: round-robin puts them on both replicas
            served = served_cls()
            parts: list[str] = []
            usage = await client.chat(dict(body), time.perf_counter(), [], parts, served)
            assert usage is not None and usage.completion_tokens == 3 and parts
            out.append(served)
    return out


@pytest.mark.card(
    CARD, "the-benchmark-clients-record-each-request-s-replica-in-its-observation", RED, GREEN
)
def test_clients_record_the_replica(servers, tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    dp2, dp1 = servers["dp2-python"].get(), servers["dp1-python"].get()
    before = routed(dp2)
    obs = observed(dp2, model_dir, tmp_path / "dp2.jsonl")
    replicas = [getattr(o, "replica", None) for o in obs]
    assert len(obs) == 6 and all(r in (0, 1) for r in replicas), replicas
    assert [getattr(o, "replicas", None) for o in obs] == [2] * 6
    delta = settled_routed(dp2, before, 6)
    assert delta == [replicas.count(0), replicas.count(1)] and min(delta) > 0, (delta, replicas)
    # dp=1 (or a peer server): the server says nothing, the observation says None
    plain = observed(dp1, model_dir, tmp_path / "dp1.jsonl")
    assert len(plain) == 6
    assert all(getattr(o, "replica", "absent") is None for o in plain)
    assert all(getattr(o, "replicas", "absent") is None for o in plain)
    # both load generators (lean and the openai SDK) read it alike
    sse = importlib.import_module("minisgl.benchmark.sse")
    served_cls = getattr(sse, "Served", None)
    assert served_cls is not None, "the clients have no place to record the replica"
    assert "served" in inspect.signature(sse.LeanClient.chat).parameters
    for kind in (sse.LeanClient, sse.OpenAIClient):
        two = asyncio.run(chat_twice(kind, dp2.base_url, served_cls))
        assert sorted(s.replica for s in two) == [0, 1] and {s.replicas for s in two} == {2}
        one = asyncio.run(chat_twice(kind, dp1.base_url, served_cls))
        assert [(s.replica, s.replicas) for s in one] == [(None, None)] * 2, kind


@pytest.mark.card(
    CARD, "the-benchmark-clients-record-each-request-s-replica-in-its-observation", RED, GREEN
)
def test_observations_carry_the_replica():
    fields = {f.name for f in dataclasses.fields(Observation)}
    assert {"replica", "replicas"} <= fields, "observations carry no replica"
    from minisgl.benchmark.observe import RunLabels, build
    from minisgl.benchmark.profiles import WorkItem

    items = [WorkItem(0, [1, 2], 2), WorkItem(1, [3], 2), WorkItem(2, [4], 2)]
    labels = RunLabels("p", "rust_service", "cpu", "m", "test")
    built = build(items, [[0.1, 0.2]] * 3, labels, replica=[1, 0, None],
                  replicas=[2, 2, None])  # fmt: skip
    assert [(o.replica, o.replicas) for o in built] == [(1, 2), (0, 2), (None, None)]
    lines = "".join(json.dumps(o.to_dict()) + "\n" for o in built)
    assert [(o.replica, o.replicas) for o in parse_jsonl(lines, "f")] == [
        (1, 2), (0, 2), (None, None)
    ]  # fmt: skip
    old = {k: v for k, v in built[0].to_dict().items() if k not in ("replica", "replicas")}
    assert parse_jsonl(json.dumps(old), "old.jsonl")[0].replica is None  # files from before
    for bad in ({"replica": -1}, {"replica": "1"}, {"replicas": 0}, {"replica": 2, "replicas": 2}):
        with pytest.raises(ObservationError, match="f.jsonl:1: .*replica"):
            parse_jsonl(json.dumps({**built[0].to_dict(), **bad}), "f.jsonl")


# --------------------------------------------------------------------------- the gate
def observation(i: int, repeat: int = 0, backend: str = "rust_service", replica=None,
                replicas=None, f: float = 1.0) -> Observation:  # fmt: skip
    fields = {f.name for f in dataclasses.fields(Observation)}
    assert {"replica", "replicas"} <= fields, "observations carry no replica"
    return Observation(
        request_id=f"seed-online-{i}", index=i, repeat=repeat, backend=backend, device="cpu",
        model="tiny", output_token_ids=(i, i + 1, i + 2, i + 3), ttft_s=0.004 * f,
        itl_s=(0.004 * f,) * 3, e2e_s=0.016 * f, prompt_tokens=8, output_tokens=4,
        kv_pages_in_use=100, replica=replica, replicas=replicas,
    )  # fmt: skip


def noisy_runs(seed: int, backend: str, dp: int | None = None, slow: dict | None = None,
               repeats: int = 6, n: int = 64) -> list[Observation]:  # fmt: skip
    """`repeats` runs of `n` requests (5% run-to-run drift, 15% per request, fixed seeds);
    with `dp`, request i of run r is served by replica (i + r) % dp, and `slow` {replica:
    factor} slows every latency of that replica."""
    rng = random.Random(seed)
    out = []
    for r in range(repeats):
        run_f = rng.lognormvariate(0.0, 0.05)
        for i in range(n):
            replica = None if dp is None else (i + r) % dp
            f = run_f * rng.lognormvariate(0.0, 0.15) * (slow or {}).get(replica, 1.0)
            out.append(observation(i, r, backend, replica, dp, f))
    return out


def segments(ev) -> dict:
    return {s.name: s for s in ev.segments}


@pytest.mark.card(
    CARD, "a-slowdown-in-one-replica-holds-that-replica-s-segment-while-the-other-passes",
    RED, GREEN,
)  # fmt: skip
def test_a_slow_replica_holds_its_own_segment():
    base = noisy_runs(0, "python")  # dp=1: no replica, matched by request id
    cand = noisy_runs(1, "rust_service", dp=2, slow={1: 1.5})
    ev = evaluate(base, cand, POLICY, "request_id")
    segs = segments(ev)
    assert set(segs) == {"rust_service@cpu", "rust_service@cpu replica 0",
                         "rust_service@cpu replica 1"}, set(segs)  # fmt: skip
    slow, fast = segs["rust_service@cpu replica 1"], segs["rust_service@cpu replica 0"]
    assert ev.decision == "hold"
    assert slow.decision == "hold"
    assert {"e2e_q0.95", "e2e_q0.5", "ttft_q0.5", "tpot_q0.5"} <= {
        s.name for s in slow.signals if s.failed
    }  # fmt: skip
    assert fast.decision == "promote" and not [s for s in fast.signals if s.failed]
    held = {item["segment"] for item in triage(ev.signals)}
    assert "rust_service@cpu replica 1" in held and "rust_service@cpu replica 0" not in held
    # every request of the workload reached each replica in some run; the dp=1 baseline's
    # observations of the same requests are the reference, whatever replica served them
    for seg, k in ((fast, 0), (slow, 1)):
        assert (seg.replica, seg.summary["requests"], seg.summary["matched"]) == (k, 64, 64)
        assert seg.summary["candidate"]["observations"] == 6 * 32
        assert seg.summary["baseline"]["observations"] == 6 * 64
    # the same candidate without its replica: one segment, the slowdown averaged in
    whole = [dataclasses.replace(o, replica=None, replicas=None) for o in cand]
    assert list(segments(evaluate(base, whole, POLICY, "request_id"))) == ["rust_service@cpu"]
    # a 15% slowdown of one replica that the whole view averages away (fixed seeds)
    cand = noisy_runs(5, "rust_service", dp=2, slow={1: 1.15})
    ev = evaluate(noisy_runs(4, "python"), cand, POLICY, "request_id")
    assert [(s.name, s.decision) for s in ev.segments] == [
        ("rust_service@cpu", "promote"), ("rust_service@cpu replica 0", "promote"),
        ("rust_service@cpu replica 1", "hold"),
    ]  # fmt: skip


def few(split: list[int], replicas: int) -> list[Observation]:
    """One run of sum(split) requests: the first split[0] on replica 0, the next on 1..."""
    out, i = [], 0
    for k, count in enumerate(split):
        for _ in range(count):
            out.append(observation(i, replica=k, replicas=replicas))
            i += 1
    return out


@pytest.mark.card(
    CARD, "a-replica-that-served-too-few-requests-holds-and-says-so", RED, GREEN
)  # fmt: skip
def test_a_replica_with_too_few_requests_holds_and_says_so():
    base = [observation(i, backend="python") for i in range(10)]
    ev = evaluate(base, few([7, 3], replicas=3), POLICY, "request_id")  # replica 2 served none
    segs = segments(ev)
    assert ev.decision == "hold"
    assert segs["rust_service@cpu"].decision == "promote"
    assert segs["rust_service@cpu replica 0"].decision == "promote"
    assert {s.name for s in ev.signals if s.failed} == {"matched_requests"}
    for k, n in ((1, 3), (2, 0)):
        seg = segs[f"rust_service@cpu replica {k}"]
        assert seg.decision == "hold" and seg.summary["requests"] == n
        (sig,) = [s for s in seg.signals if s.failed]
        assert sig.name == "matched_requests" and sig.value == n and sig.threshold == 5
        assert f"replica {k} served {n} of the candidate's 10 request(s)" in sig.detail
        assert "evidence.min_matched_requests (5)" in sig.detail, sig.detail
    assert {i["segment"] for i in triage(ev.signals)} == {
        "rust_service@cpu replica 1", "rust_service@cpu replica 2"
    }  # fmt: skip


@pytest.mark.card(CARD, "the-report-shows-the-requests-per-replica", RED, GREEN)
def test_the_report_shows_the_split(tmp_path, capsys):
    base = [observation(i, backend="python") for i in range(10)]
    cand = few([7, 3], replicas=3)
    for name, rows in (("b.jsonl", base), ("c.jsonl", cand)):
        (tmp_path / name).write_text("".join(json.dumps(o.to_dict()) + "\n" for o in rows))
    out = tmp_path / "r.json"
    rc = release_gate.main(
        ["--baseline", str(tmp_path / "b.jsonl"), "--candidate", str(tmp_path / "c.jsonl"),
         "--out", str(out)]
    )  # fmt: skip
    assert rc == release_gate.EXIT["hold"]  # the default policy: 8 matched a segment
    text = capsys.readouterr().out
    assert "segment rust_service@cpu: promote" in text  # the whole: 10 requests, 8 needed
    report = json.loads(out.read_text())
    by_name = {s["name"]: s for s in report["segments"]}
    whole = by_name["rust_service@cpu"]
    assert whole["replica"] is None
    assert whole["summary"]["replicas"] == {
        "replicas": 3,
        "split": [
            {"replica": 0, "segment": "rust_service@cpu replica 0", "requests": 7,
             "observations": 7, "matched": 7, "decision": "hold"},
            {"replica": 1, "segment": "rust_service@cpu replica 1", "requests": 3,
             "observations": 3, "matched": 3, "decision": "hold"},
            {"replica": 2, "segment": "rust_service@cpu replica 2", "requests": 0,
             "observations": 0, "matched": 0, "decision": "hold"},
        ],
        "unattributed_observations": 0,
    }  # fmt: skip
    assert by_name["rust_service@cpu replica 1"]["replica"] == 1
    assert "split by replica: replica 0: 7 request(s), replica 1: 3 request(s), replica 2: 0 " \
           "request(s)" in text  # fmt: skip
    assert "segment rust_service@cpu replica 1: hold (3 request(s))" in text
    assert "matched_requests [rust_service@cpu replica 2]: replica 2 served 0" in "\n".join(
        report["reasons"]
    )


@pytest.mark.card(CARD, "observations-without-a-replica-keep-today-s-segments", GREEN)
def test_observations_without_a_replica_keep_todays_segments(tmp_path, capsys):
    base = [observation(i, backend="python", replica=i % 2, replicas=2) for i in range(10)]
    cand = [observation(i) for i in range(10)]  # dp=1 candidate against a dp=2 baseline
    ev = evaluate(base, cand, POLICY, "request_id")
    assert [s.name for s in ev.segments] == ["rust_service@cpu"] and ev.decision == "promote"
    assert "replicas" not in ev.segments[0].summary
    # a file written before replicas existed reads as before
    rows = [{k: v for k, v in o.to_dict().items() if k not in ("replica", "replicas")}
            for o in cand]  # fmt: skip
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(o.to_dict()) + "\n" for o in base))
    rc = release_gate.main(
        ["--baseline", str(tmp_path / "b.jsonl"), "--candidate", str(tmp_path / "c.jsonl"),
         "--out", str(tmp_path / "r.json")]
    )  # fmt: skip
    assert rc == 0
    assert "split by replica" not in capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert [s["name"] for s in report["segments"]] == ["rust_service@cpu"]
