"""P1-013 (issue 39 item 2): `LLM(..., cpu_backend="rust_service")` runs the out-of-process
Rust service the server uses, the model in this process as its worker: fp32 greedy
token-identical to the python backend, and the service never outlives the `LLM`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from minisgl import LLM, SamplingParams
from minisgl.testing.modules import require_module

CARD = "P1-013"
RED = "failing-tests-the-runtime-object-offline-rust-service-parity-and-cleanup"
GREEN = "the-runtime-serves-every-loop-and-the-offline-api-runs-on-the-rust-service"
ROOT = Path(__file__).resolve().parents[1]
KW = dict(
    dtype="float32",
    num_pages=512,
    max_seq_len_override=128,
    max_running_requests=8,
    max_extend_tokens=48,
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from minisgl.testing.tiny_models import write_tiny_model

    return write_tiny_model("llama", tmp_path_factory.mktemp("offline-svc-llama"), seed=0)


def workload() -> tuple[list, list[SamplingParams]]:
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 300, size=20).tolist()
    ps: list = [rng.integers(3, 300, size=int(rng.integers(2, 60))).tolist() for _ in range(7)]
    ps += [
        [*shared, 9],
        [*shared, 10, 11],
        "The quick brown fox",
        [{"role": "user", "content": "Paris?"}],
    ]
    params = [
        SamplingParams(max_tokens=4 + 5 * (k % 4), ignore_eos=k % 3 == 0) for k in range(len(ps))
    ]
    params[1] = SamplingParams(max_tokens=10, n=3)  # n > 1 shares the prompt's KV
    params[2] = SamplingParams(max_tokens=8, logprobs=2, ignore_eos=True)
    return ps, params


def samples(results: list[dict]) -> list[tuple]:
    return [
        (s["token_ids"], s["finish_reason"], s["text"], s["error"])
        for r in results
        for s in r["outputs"]
    ]


@pytest.mark.card(CARD, "token-identical-to-the-python-backend-in-fp32", RED, GREEN)
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_offline_rust_service_is_token_identical_to_python(tiny_llama: Path, overlap: bool) -> None:
    require_module("minisgl.runtime")
    ps, params = workload()
    python = LLM(tiny_llama, overlap=overlap, cpu_backend="python", **KW)
    try:
        want = python.generate(ps, params)
    finally:
        python.close()
    # a stop string taken from one python output: two ASCII letters past its start (a
    # replacement character of a partial UTF-8 sequence is no stop string)
    text = want[3]["text"]
    stop = next(
        (text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].isascii()
         and text[i : i + 2].isalpha()),
        "e",
    )  # fmt: skip
    stopped = [ps[3]], [SamplingParams(max_tokens=12, ignore_eos=True, stop=stop)]
    python = LLM(tiny_llama, overlap=overlap, cpu_backend="python", **KW)
    try:
        want_stop = python.generate(*stopped)
    finally:
        python.close()
    service = LLM(tiny_llama, overlap=overlap, cpu_backend="rust_service", **KW)
    try:
        got = service.generate(ps, params)
        got_stop = service.generate(*stopped)
    finally:
        service.close()
    assert samples(got) == samples(want)
    assert samples(got_stop) == samples(want_stop)
    lp_want = [(lp.token_id, round(lp.logprob, 4)) for lp in want[2]["logprobs"]]
    lp_got = [(lp.token_id, round(lp.logprob, 4)) for lp in got[2]["logprobs"]]
    assert lp_got == lp_want


def gone(pid: int, wait_s: float = 10.0) -> bool:
    """The process exited (a zombie left for init counts as gone)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.card(CARD, "the-service-process-is-cleaned-up-on-close-and-on-exit", RED, GREEN)
def test_the_service_process_ends_on_close(tiny_llama: Path) -> None:
    require_module("minisgl.runtime")
    llm = LLM(tiny_llama, cpu_backend="rust_service", **KW)
    pid = llm.runtime.service_pid
    assert isinstance(pid, int) and not gone(pid, 0.2)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    llm.close()
    assert gone(pid), f"the service (pid {pid}) outlived LLM.close()"
    llm.close()  # twice is fine


CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    from minisgl import LLM, SamplingParams
    llm = LLM(sys.argv[1], cpu_backend="rust_service", **json.loads(sys.argv[2]))
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    print(json.dumps({"service_pid": llm.runtime.service_pid}), flush=True)
    if sys.argv[3] == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.card(CARD, "the-service-process-is-cleaned-up-on-close-and-on-exit", RED, GREEN)
@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_the_service_process_ends_with_its_process(tiny_llama: Path, how: str) -> None:
    require_module("minisgl.runtime")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINISGL_CPU_BACKEND")}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_llama), json.dumps(KW), how],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    want_rc = -signal.SIGKILL if how == "sigkill" else 0
    assert proc.returncode == want_rc, proc.stderr[-4000:]
    pid = json.loads(proc.stdout.strip().splitlines()[-1])["service_pid"]
    assert gone(pid), f"the service (pid {pid}) outlived its LLM's process ({how})"


@pytest.mark.parametrize("backend", ["python", "rust_service"])
def test_n_choices_are_seeded_seed_plus_i(tiny_llama: Path, backend: str) -> None:
    """Issue 60 item 1: choice i of a seeded n > 1 request samples with `seed + i` (as the
    server does, docs/server.md), on either backend: n=3 gives the three n=1 draws."""
    require_module("minisgl.runtime")
    prompt = [[5, 6, 7, 8, 9]]
    kw = dict(max_tokens=8, temperature=0.9, ignore_eos=True)
    llm = LLM(tiny_llama, cpu_backend=backend, **KW)
    try:
        got = [
            s["token_ids"]
            for s in llm.generate(prompt, SamplingParams(n=3, seed=1, **kw))[0]["outputs"]
        ]
        one = [
            llm.generate(prompt, SamplingParams(seed=s, **kw))[0]["token_ids"] for s in (1, 2, 3)
        ]
    finally:
        llm.close()
    assert len({tuple(t) for t in got}) == 3, got
    assert got == one
