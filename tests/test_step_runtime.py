"""P1-013 (issue 39 item 3): one request/step runtime object drives every step loop.

The offline API, the python engine worker and the rust_service GPU worker step through
`minisgl.runtime.Runtime`; the serial loop is its overlap depth 0; the `Scheduler` is made of
admission, decode, prefix cache and in-flight parts (guarded as a refactor by the scheduler's
state machines and replay fingerprints)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from minisgl import LLM, SamplingParams
from minisgl.testing.modules import require_module

CARD = "P1-013"
RED = "failing-tests-the-runtime-object-offline-rust-service-parity-and-cleanup"
GREEN = "the-runtime-serves-every-loop-and-the-offline-api-runs-on-the-rust-service"
KW = dict(
    dtype="float32",
    num_pages=512,
    max_seq_len_override=128,
    max_running_requests=8,
    max_extend_tokens=64,
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from minisgl.testing.tiny_models import write_tiny_model

    return write_tiny_model("llama", tmp_path_factory.mktemp("runtime-llama"), seed=0)


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 300, size=12).tolist()
    out = [rng.integers(3, 300, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]
    return [*out, [*shared, 5, 6], [*shared, 7]]  # a prefix hit


def params(k: int) -> SamplingParams:
    return SamplingParams(max_tokens=6 + 3 * (k % 3), ignore_eos=k % 2 == 0)


def counting(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> Counter:
    calls: Counter = Counter()
    orig = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        calls[name] += 1
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapped)
    return calls


class Sink:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def send(self, frame: bytes) -> None:
        self.frames.append(frame)


@pytest.mark.card(
    CARD, "the-offline-api-and-the-engine-worker-step-through-the-runtime", RED, GREEN
)
def test_the_offline_api_and_the_engine_worker_step_through_the_runtime(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime_cls = require_module("minisgl.runtime").Runtime
    from minisgl.message.schema import AddReq, Codec, TokenOut, WireParams
    from minisgl.server.engine_worker import EngineLoop

    calls = counting(monkeypatch, runtime_cls, "step")
    llm = LLM(tiny_llama, overlap=False, **KW)
    try:
        assert isinstance(llm.runtime, runtime_cls)
        ps = prompts()
        want = llm.generate(ps, [params(k) for k in range(len(ps))])
        assert calls["step"] > 0, "LLM.generate did not step through the runtime"
        offline_steps = calls["step"]
        codec, tok, front = Codec(True), Sink(), Sink()
        loop = EngineLoop(llm.runtime, codec, [tok], front)
        for k, ids in enumerate(ps):
            p = params(k)
            wire = WireParams(max_tokens=p.max_tokens, ignore_eos=p.ignore_eos)
            loop.handle(AddReq(k + 1, np.asarray(ids, np.int32), wire))
        loop.flush_admitted()
        for _ in range(1000):
            if not llm.runtime.has_work():
                break
            loop.step()
        got: dict[int, list[int]] = {}
        for frame in tok.frames:
            msg = codec.decode(frame)
            if isinstance(msg, TokenOut):
                for uid, t in zip(msg.uids.tolist(), msg.tokens.tolist(), strict=True):
                    got.setdefault(uid, []).append(t)
        assert calls["step"] > offline_steps, "the engine worker did not step through the runtime"
        assert got == {k + 1: w["token_ids"] for k, w in enumerate(want)}
    finally:
        llm.close()


@pytest.mark.card(CARD, "the-gpu-worker-runs-the-service-s-steps-through-the-runtime", RED, GREEN)
def test_the_gpu_worker_runs_the_service_steps_through_the_runtime(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime_cls = require_module("minisgl.runtime").Runtime
    from minisgl.server import gpu_worker

    recorded = []
    execute = runtime_cls.execute

    def record(self, step):
        res = execute(self, step)
        recorded.append((step, res.tokens.tolist()))
        return res

    monkeypatch.setattr(runtime_cls, "execute", record)
    ps = prompts(seed=1)
    service = LLM(tiny_llama, cpu_backend="rust_service", **KW)
    try:
        service.generate(ps, [params(k) for k in range(len(ps))])
    finally:
        service.close()
    assert recorded, "the offline rust_service API ran no step through Runtime.execute"
    assert not hasattr(gpu_worker, "StepRunner"), "the GPU worker still has its own step runner"
    replay = list(recorded)  # the replay below records too
    fresh = LLM(tiny_llama, overlap=False, **KW)  # the server's GPU worker: the same object
    try:
        for step, tokens in replay:
            res = gpu_worker.run_step(fresh.runtime, step)
            assert res.fatal is None and res.tokens.tolist() == tokens
    finally:
        fresh.close()


@pytest.mark.card(CARD, "the-serial-loop-is-overlap-depth-0-of-the-same-code", RED, GREEN)
def test_the_serial_loop_is_overlap_depth_0_of_the_same_code(tiny_llama: Path) -> None:
    require_module("minisgl.runtime")
    serial = LLM(tiny_llama, overlap=False, **KW)
    ahead = LLM(tiny_llama, overlap=True, device_stream="thread", **KW)
    try:
        assert (serial.runtime.depth, ahead.runtime.depth) == (0, 1)
        assert type(serial.runtime.loop) is type(ahead.runtime.loop)
        ps = prompts(seed=2)
        ps_params = [params(k) for k in range(len(ps))]
        a = [r["token_ids"] for r in serial.generate(ps, ps_params)]
        b = [r["token_ids"] for r in ahead.generate(ps, ps_params)]
        assert a == b
    finally:
        serial.close()
        ahead.close()


PARTS = {
    "admission": "Admission",
    "decode": "Decode",
    "prefix_cache": "PrefixCache",
    "inflight": "InFlight",
}


@pytest.mark.card(
    CARD,
    "the-scheduler-class-split-into-admission-decode-prefix-cache-and-in-flight-parts",
    RED,
    GREEN,
)
def test_the_scheduler_is_made_of_its_parts() -> None:
    from minisgl.scheduler import scheduler

    for module, name in PARTS.items():
        part = getattr(require_module(f"minisgl.scheduler.{module}"), name, None)
        assert part is not None, f"minisgl.scheduler.{module} has no {name}"
        assert issubclass(scheduler.Scheduler, part), f"Scheduler is not made of {name}"
    lines = Path(scheduler.__file__).read_text().count("\n")
    assert lines < 350, f"scheduler.py is still {lines} lines"
