"""`/openapi.json` describes the real validation; a bounded schemathesis run over both endpoints
finds no 5xx, every 4xx has an OpenAI error body, and nothing stays in flight."""

from __future__ import annotations

import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402


def test_openapi_json_names_the_new_parameters(server):
    spec = httpx.get(server.base_url + "/openapi.json", timeout=10).json()
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    props = body["schema"]["properties"]
    for name in ("min_p", "logit_bias", "presence_penalty", "n", "logprobs", "min_tokens"):
        assert name in props
    assert props["max_tokens"]["maximum"] == 256


def check(case, server) -> None:
    if isinstance(case.body, dict):  # bounded work per example
        if isinstance(case.body.get("n"), int) and case.body["n"] > 2:
            case.body["n"] = 2
        for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
            if isinstance(case.body.get(key), int) and case.body[key] > 4:
                case.body[key] = 4
    r = case.call(base_url=server.base_url, timeout=60)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
    deadline = time.monotonic() + 10
    while httpx.get(server.base_url + "/health", timeout=5).json()["in_flight"]:
        assert time.monotonic() < deadline, "a request stayed in flight"
        time.sleep(0.05)


@pytest.mark.slow
def test_fuzz_endpoints_never_5xx(server):
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    ops = [op for op in ops if op.method.upper() == "POST"]
    assert len(ops) == 2
    for op in ops:

        @given(case=op.as_strategy())
        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
        def run(case):
            check(case, server)

        run()
