"""Issue 39 (TPOT on the rust_service backend): the GPU worker runs the Rust service's steps on
a device stream and submits step k+1 while the device runs step k, as the python backend's
overlap loop does; a step with a row whose sampler reads committed outputs (penalties, a seeded
draw, min_tokens) waits for the steps before it. Tokens are those of the serial worker."""

from __future__ import annotations

import select
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from minisgl.engine.stream import ThreadStream
from minisgl.testing.modules import require_module

CARD = "P1-015"
RED = "pipelined-worker-tests-fail-before-the-pipeline-exists"
GREEN = "pipelined-worker-tests-pass"
OVERLAP = "greedy-steps-go-to-the-device-while-the-step-before-runs-with-the-serial-tokens"
WAIT = "a-step-whose-sampler-reads-committed-outputs-waits-for-the-steps-before-it"
SIGNAL = "a-finished-step-is-signalled-on-a-file-descriptor-the-worker-polls"
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

    return write_tiny_model("llama", tmp_path_factory.mktemp("pipeline-llama"), seed=0)


class LoggedStream(ThreadStream):
    """A slow device stream that logs each submit and each result read, in order."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        super().__init__(delay_s=0.003)
        self.log = log
        self.n = 0

    def submit(self, job):
        k = self.n
        self.n += 1
        self.log.append(("submit", k))
        inner = super().submit(job)
        log = self.log

        class Handle:
            def result(self):
                res = inner.result()
                log.append(("result", k))
                return res

        return Handle()


def record_steps(model: Path, monkeypatch: pytest.MonkeyPatch, params: list[SamplingParams]):
    runtime_cls = require_module("minisgl.runtime").Runtime
    recorded = []
    execute = runtime_cls.execute

    def record(self, step):
        res = execute(self, step)
        recorded.append((step, res.tokens.tolist()))
        return res

    monkeypatch.setattr(runtime_cls, "execute", record)
    prompts = [[3 + i, 50 + 7 * i, 9, 11 + i] * (1 + i % 3) for i in range(len(params))]
    llm = LLM(model, cpu_backend="rust_service", **KW)
    try:
        llm.generate(prompts, params)
    finally:
        llm.close()
        monkeypatch.setattr(runtime_cls, "execute", execute)
    return recorded


def replay(model: Path, recorded, log: list[tuple[str, int]]) -> list[list[int]]:
    from minisgl.runtime.service_steps import ServicePipeline

    fresh = LLM(model, overlap=False, **KW)
    pipe = ServicePipeline(fresh.runtime.steps, LoggedStream(log), depth=2)
    prepare = pipe.steps.prepare

    def logged(step):  # which steps may go ahead: all of their rows greedy
        prepared = prepare(step)
        log.append(("ahead" if prepared.goes_ahead else "waits", prepared.step))
        return prepared

    pipe.steps.prepare = logged
    got: dict[int, list[int]] = {}
    try:
        for step, _ in recorded:
            for res in pipe.submit(step):
                got[res.step] = res.tokens.tolist()
            while pipe.pending >= 2:
                res = pipe.wait_oldest()
                got[res.step] = res.tokens.tolist()
        while pipe.pending:
            res = pipe.wait_oldest()
            got[res.step] = res.tokens.tolist()
    finally:
        pipe.close()
        fresh.close()
    return [got[step.step] for step, _ in recorded]


def overlapped(log: list[tuple[str, int]], waiting_only: bool = False) -> int:
    """Steps submitted while the one before had not been read back (`waiting_only`: of the
    steps that had to wait, a row of theirs not greedy)."""
    read: set[int] = set()
    waits = {k for what, k in log if what == "waits"}
    n = 0
    for what, k in log:
        if what == "result":
            read.add(k)
        elif what == "submit" and k > 0 and k - 1 not in read:
            n += not waiting_only or k in waits
    return n


@pytest.mark.card(CARD, OVERLAP, RED, GREEN)
def test_greedy_steps_overlap_and_keep_their_tokens(tiny_llama, monkeypatch):
    greedy = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 4
    recorded = record_steps(tiny_llama, monkeypatch, greedy)
    log: list[tuple[str, int]] = []
    tokens = replay(tiny_llama, recorded, log)
    assert tokens == [t for _, t in recorded]
    decode_steps = sum(1 for step, _ in recorded if not step.is_prefill)
    assert decode_steps >= 5
    assert overlapped(log) >= decode_steps - 2  # every decode step went ahead of its reader


@pytest.mark.card(CARD, WAIT, RED, GREEN)
def test_a_step_with_penalties_waits_for_the_steps_before_it(tiny_llama, monkeypatch):
    mixed = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, presence_penalty=1.5),
        SamplingParams(temperature=0.9, top_k=20, max_tokens=8, ignore_eos=True, seed=7),
    ]
    recorded = record_steps(tiny_llama, monkeypatch, mixed)
    log: list[tuple[str, int]] = []
    tokens = replay(tiny_llama, recorded, log)
    assert tokens == [t for _, t in recorded]  # penalties and the seeded draw saw every token
    assert sum(1 for what, _ in log if what == "submit") == len(recorded)  # on the stream
    # the service admits requests as they arrive: a first step may hold the greedy one alone
    # (and go ahead); every step with a penalty or a seeded row waited
    waiting = sum(1 for what, _ in log if what == "waits")
    assert waiting >= 6, log  # the decode steps of the penalty and the seeded request
    assert overlapped(log, waiting_only=True) == 0


@pytest.mark.card(CARD, SIGNAL, RED, GREEN)
def test_the_pipeline_signals_a_finished_step_on_its_file_descriptor(tiny_llama, monkeypatch):
    greedy = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)] * 2
    recorded = record_steps(tiny_llama, monkeypatch, greedy)
    from minisgl.runtime.service_steps import ServicePipeline

    fresh = LLM(tiny_llama, overlap=False, **KW)
    pipe = ServicePipeline(fresh.runtime.steps, ThreadStream(delay_s=0.002), depth=2)
    try:
        assert pipe.submit(recorded[0][0]) == []
        readable, _, _ = select.select([pipe.fileno()], [], [], 5.0)
        assert readable == [pipe.fileno()]
        done = pipe.ready()
        assert [r.tokens.tolist() for r in done] == [recorded[0][1]] and pipe.pending == 0
    finally:
        pipe.close()
        fresh.close()
