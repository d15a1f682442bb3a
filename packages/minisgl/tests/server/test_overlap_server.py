"""Overlap scheduling through the Python server's engine worker: on a slow fake device stream
(a worker thread that sleeps before each step), concurrent requests get the serial offline
loop's tokens (max_tokens, EOS, stop ids, stop strings, shared prefixes), a client that leaves
mid-stream is aborted with its next step in flight, and every KV page comes back."""

from __future__ import annotations

import asyncio

import httpx

from minisgl import LLM, SamplingParams
from minisgl.testing.scenarios import random_prompts
from minisgl.testing.server import metric, running_server, wait_kv_clean

STEM = random_prompts(1, 20, 20, seed=31)[0]


def test_engine_worker_overlap_matches_the_serial_loop(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    serial = LLM(path, num_pages=4096, max_seq_len_override=256, overlap=False)
    prompts = [*random_prompts(6, 3, 50, seed=30), [*STEM, 7, 8], [*STEM, 9]]
    free = serial.generate(prompts[:1], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    cases = [
        (prompts[0], dict(max_tokens=12, ignore_eos=True, stop_token_ids=[free["token_ids"][6]])),
        (prompts[0], dict(max_tokens=12, ignore_eos=True, stop=[free["text"][4:7] or "a"])),
        *((p, dict(max_tokens=3 + 4 * i, ignore_eos=i % 2 == 0)) for i, p in enumerate(prompts)),
    ]
    want = serial.generate([p for p, _ in cases], [SamplingParams(**kw) for _, kw in cases])
    env = {"MINISGL_DEVICE_STREAM": "slow:3", "MINISGL_LOG_LEVEL": "INFO"}
    with running_server(path, log_dir=tmp_path, env=env) as server:

        async def one(c: httpx.AsyncClient, prompt, kw):
            r = await c.post("/v1/completions", json={"prompt": prompt, "temperature": 0, **kw})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        async def leave(c: httpx.AsyncClient) -> int:
            body = {"prompt": prompts[1], "max_tokens": 200, "ignore_eos": True, "stream": True}
            got = 0
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    got += line.startswith("data: {")
                    if got == 3:
                        break  # the client leaves: aborted, its next step in flight
            return got

        async def main():
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
                return await asyncio.gather(leave(c), *(one(c, p, kw) for p, kw in cases))

        left, *got = asyncio.run(main())
        assert left == 3
        for g, w in zip(got, want, strict=True):
            assert (g["text"], g["finish_reason"]) == (w["text"], w["finish_reason"])
        assert got[0]["finish_reason"] == got[1]["finish_reason"] == "stop"
        assert "overlap scheduling on (slow:3 device stream)" in server.log()
        text = wait_kv_clean(server, timeout=60)
        assert metric(text, "minisgl_requests_total", '{outcome="aborted"}') == 1
