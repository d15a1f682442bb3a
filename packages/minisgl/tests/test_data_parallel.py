"""Issue 37: data-parallel replicas (`--dp N`) behind one control plane: dp=2 is token-identical
to dp=1 on both backends, /health and /metrics show the split per replica, the Rust service
sends shared-prefix traffic to the replica holding the prefix (a prefix hit rate above
round-robin's, measured), and a replica whose worker dies leaves the rotation with a clear
error while the other keeps serving."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from minisgl import LLM, SamplingParams
from minisgl.testing.scenarios import random_prompts
from minisgl.testing.server import metric, metrics, start

CARD = "P4-002"
RED = "data-parallel-tests-fail-before-replicas-exist"
GREEN = "data-parallel-tests-pass"
NEW = 8
FLAGS = ("--dp", "2", "--threads", "1", "--served-model-name", "m")
BACKENDS = ["python", "rust_service"]


def post(server, prompt, max_tokens: int = NEW, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", timeout=timeout, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})  # fmt: skip


def replicas(server) -> list[dict]:
    body = httpx.get(server.base_url + "/health", timeout=10).json()
    reps = body.get("replicas")
    assert isinstance(reps, list) and len(reps) == 2, f"/health shows no 2 replicas: {body}"
    return reps


def replica_metric(text: str, name: str, i: int) -> float:
    return metric(text, name, f'{{replica="{i}"}}')


def settled_metrics(server, prompt_tokens: int, timeout: float = 15.0) -> str:
    """/metrics once the scheduler stats count every prompt token sent (stats lag a step)."""
    deadline = time.monotonic() + timeout
    while True:
        text = metrics(server)
        if metric(text, "minisgl_prompt_tokens_total") >= prompt_tokens:
            return text
        assert time.monotonic() < deadline, f"stats never counted {prompt_tokens} prompt tokens"
        time.sleep(0.2)


def offline_texts(path, prompts: list[list[int]]) -> list[str]:
    """dp=1: the offline engine on the same model, decoded as the server decodes."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    llm = LLM(path, num_pages=4096, max_seq_len_override=256)
    try:
        outs = llm.generate(prompts, greedy)
    finally:
        llm.close()
    return [tok.decode(o["token_ids"], skip_special_tokens=True) for o in outs]


@pytest.mark.card(
    CARD,
    "dp-2-greedy-decoding-is-token-identical-to-dp-1-on-both-scheduler-backends",
    "metrics-and-health-show-per-replica-counts",
    RED,
    GREEN,
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dp2_matches_dp1(backend, tiny_model_dir, tmp_path):
    path = tiny_model_dir("qwen2")
    prompts = random_prompts(8, 3, 40, seed=5)
    want = offline_texts(path, prompts)
    with start("dp2", path, *FLAGS, log_dir=tmp_path, backend=backend) as s:
        server = s.get()
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda p: post(server, p), prompts))
        assert [r.status_code for r in replies] == [200] * len(prompts), replies[0].text
        assert [r.json()["choices"][0]["text"] for r in replies] == want
        reps = replicas(server)
        assert [r["replica"] for r in reps] == [0, 1]
        assert all(r["alive"] for r in reps)
        assert sum(r["routed"] for r in reps) == len(prompts)
        assert all(r["routed"] > 0 for r in reps), f"one replica took everything: {reps}"
        text = settled_metrics(server, sum(map(len, prompts)))
        for i in (0, 1):
            assert replica_metric(text, "minisgl_replica_requests_routed_total", i) > 0
            assert replica_metric(text, "minisgl_replica_prompt_tokens_total", i) > 0
            assert replica_metric(text, "minisgl_replica_cached_prompt_tokens_total", i) >= 0
            assert replica_metric(text, "minisgl_replica_num_running_requests", i) == 0
            assert replica_metric(text, "minisgl_replica_healthy", i) == 1


def shared_prefix_groups(groups: int, per_group: int, prefix: int, suffix: int) -> list:
    rng = random.Random(37)
    out = []
    for _ in range(groups):
        head = [rng.randrange(3, 300) for _ in range(prefix)]
        out.append([head + [rng.randrange(3, 300) for _ in range(suffix)]
                    for _ in range(per_group)])  # fmt: skip
    return out


@pytest.mark.card(
    CARD, "the-rust-service-routes-shared-prefix-traffic-to-the-replica-holding-the-prefix",
    RED, GREEN,
)  # fmt: skip
def test_prefix_routing_beats_round_robin(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    groups = shared_prefix_groups(4, 4, prefix=96, suffix=6)
    total = sum(len(p) for g in groups for p in g)
    rates: dict[str, float] = {}
    for routing in ("round_robin", "prefix"):
        flags = (*FLAGS, "--dp-routing", routing)
        with start(routing, path, *flags, log_dir=tmp_path, backend="rust_service") as s:
            server = s.get()
            for group in groups:  # one request after the other: round-robin splits each group
                for prompt in group:
                    r = post(server, prompt, max_tokens=2)
                    assert r.status_code == 200, r.text
            text = settled_metrics(server, total)
            cached = metric(text, "minisgl_cached_prompt_tokens_total")
            rates[routing] = cached / metric(text, "minisgl_prompt_tokens_total")
            routed = [replica_metric(text, "minisgl_replica_requests_routed_total", i)
                      for i in (0, 1)]  # fmt: skip
            assert min(routed) > 0, f"{routing}: one replica took everything: {routed}"
            hits = [replica_metric(text, "minisgl_replica_cached_prompt_tokens_total", i)
                    for i in (0, 1)]  # fmt: skip
            assert sum(hits) == cached
    assert rates["prefix"] > rates["round_robin"] + 0.1, rates


def long_request(server, prompt, stream: bool, out: list, i: int) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": 120, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    try:
        if not stream:
            r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
            out[i] = ("json", r.status_code, r.text)
            return
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body,
                          timeout=120) as r:  # fmt: skip
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        out[i] = ("sse", r.status_code, events)
    except httpx.HTTPError as e:
        out[i] = ("transport", 0, repr(e))


def failed_clearly(result) -> bool | None:
    """True: failed with a clear replica error; False: succeeded; raises on anything else."""
    kind, status, payload = result
    if kind == "json":
        if status == 200:
            return False
        err = json.loads(payload)["error"]
        assert "replica 1" in err["message"], payload
        return True
    assert kind == "sse" and status == 200, result
    events = [json.loads(e) for e in payload if e != "[DONE]"]
    errors = [e["error"] for e in events if "error" in e]
    if not errors:
        return False
    assert "replica 1" in errors[0]["message"], errors
    return True


@pytest.mark.card(
    CARD, "a-replica-that-dies-leaves-the-rotation-with-a-clear-error-while-the-rest-keep-serving",
    RED, GREEN,
)  # fmt: skip
@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_replica_leaves_the_rotation(backend, tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    prompts = random_prompts(8, 4, 12, seed=3)
    env = {"MINISGL_FAULT_STEP_DELAY_MS": "30"}  # the long requests are still running
    with start("dp2-kill", path, *FLAGS, log_dir=tmp_path, backend=backend, env=env) as s:
        server = s.get()
        reps = replicas(server)
        out: list = [None] * 4
        threads = []
        for i, stream in enumerate([True, False, False, True]):
            t = threading.Thread(target=long_request, args=(server, prompts[i], stream, out, i))
            t.start()
            threads.append(t)
            time.sleep(0.3)
        time.sleep(1.0)
        os.kill(reps[1]["pid"], signal.SIGKILL)
        for t in threads:
            t.join(150)
        failed = [failed_clearly(r) for r in out]
        assert any(failed) and not all(failed), out
        deadline = time.monotonic() + 15
        while replicas(server)[1]["alive"]:
            assert time.monotonic() < deadline, "replica 1 still in rotation"
            time.sleep(0.2)
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        for p in prompts[4:]:
            r = post(server, p, max_tokens=4)
            assert r.status_code == 200, r.text
        text = metrics(server)
        assert replica_metric(text, "minisgl_replica_healthy", 1) == 0
        assert replica_metric(text, "minisgl_replica_healthy", 0) == 1
        # the last replica: the server ends with a clear error (and no process survives)
        os.kill(reps[0]["pid"], signal.SIGKILL)
        server.proc.wait(60)
        assert server.proc.returncode != 0
        assert "every replica" in server.log()
