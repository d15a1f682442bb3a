"""The simulated device (`--sim-device`): its token rule, its step time, its flag, and that every
CPU backend running on it gives the same greedy outputs."""

from __future__ import annotations

import numpy as np
import pytest

from minisgl.config import EngineConfig, SimDevice
from minisgl.core import SamplingParams
from minisgl.engine import sim
from minisgl.engine.sim import SimEngine, make_engine, sim_tokens
from minisgl.llm import LLM
from minisgl.server.args import parse_args

SMALL = dict(num_pages=1024, max_seq_len_override=128)


def test_parse_spec():
    assert SimDevice.parse("0.5,0.002") == SimDevice(0.5, 0.002)
    assert SimDevice.parse("2") == SimDevice(2.0, 0.002)
    assert SimDevice.parse("default") == SimDevice() == SimDevice(0.5, 0.002)
    assert SimDevice.parse(" 0,0 ") == SimDevice(0.0, 0.0)
    assert SimDevice(1.0, 0.01).step_s(100) == pytest.approx(0.002)
    assert SimDevice(0.25, 0.5).spec() == "0.25,0.5"
    for bad in ("x", "1,2,3", "-1", "0.5,-0.1", "nan", "inf", "0.5,"):
        with pytest.raises(ValueError, match="BASE_MS"):
            SimDevice.parse(bad)


def test_engine_config_rejects_a_bad_spec(tiny_model_dir):
    with pytest.raises(ValueError, match="--sim-device"):
        EngineConfig(model_path=str(tiny_model_dir("llama")), sim_device="fast")


def test_server_flag():
    assert parse_args(["--sim-device"]).sim_device == "default"
    args = parse_args(["--sim-device", "1,0.01"])
    assert args.sim_device == "1,0.01"
    assert args.llm_kwargs()["sim_device"] == "1,0.01"
    assert parse_args([]).llm_kwargs()["sim_device"] is None
    with pytest.raises(SystemExit):
        parse_args(["--sim-device", "-3"])


def test_token_rule_is_a_pure_function_in_range_and_never_eos():
    last = np.array([5, 5, 7, 300, 0], dtype=np.int32)
    pos = np.array([10, 10, 10, 11, 1], dtype=np.int64)
    a = sim_tokens(last, pos, 384, frozenset({0}))
    assert a.tolist() == sim_tokens(last.copy(), pos.copy(), 384, frozenset({0})).tolist()
    assert a[0] == a[1]  # same (token, position): same token
    assert len(set(a[1:].tolist())) == 4  # different inputs spread (splitmix64)
    assert ((a >= 96) & (a < 384)).all()  # min(100, vocab // 4) = 96
    # every id but 150 and 383 is EOS: the rule walks past them to a legal one
    eos = frozenset(range(96, 384)) - {150, 383}
    many = sim_tokens(np.arange(200), np.arange(200) + 3, 384, eos)
    assert set(many.tolist()) <= {150, 383}
    keyed = sim_tokens(last, pos, 384, frozenset(), np.array([1, 2, 0, 0, 0], np.uint64))
    assert keyed[0] != keyed[1]  # a sampled row's key changes its draw
    with pytest.raises(ValueError, match="no non-EOS token"):
        sim_tokens(last, pos, 8, frozenset(range(8)))


def test_token_rule_keeps_its_values():
    """The token rule is part of every simulated benchmark's output digest: a faster version
    must give the same tokens (these values are those of the version before 2026-11-28's)."""
    last = np.array([5, 7, 300, 0, 49151, 123], dtype=np.int32)
    pos = np.array([10, 10, 11, 1, 4000, 77], dtype=np.int64)
    got = sim_tokens(last, pos, 49152, frozenset({0, 2}))
    assert got.dtype == np.int64
    assert got.tolist() == [47252, 44879, 48307, 13077, 1891, 17190]
    keys = np.array([1, 2, 3, 0, 2**63, 9], np.uint64)
    keyed = sim_tokens(last, pos, 49152, frozenset(), keys)
    assert keyed.tolist() == [36888, 36851, 46739, 45672, 22281, 21019]


class FakeClock:
    """Host time that moves only when the host sleeps or works (`advance`)."""

    def __init__(self) -> None:
        self.t = 100.0
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(sim.time, "monotonic", fake.now)
    monkeypatch.setattr(sim.time, "sleep", fake.sleep)
    return fake


def test_step_sleeps_the_documented_time(clock, tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), sim_device="1,0.25", **SMALL)
    assert isinstance(llm.engine, SimEngine)
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0]["token_ids"]) == 3
    # a 5-token prefill, then two 1-token decodes: 1 ms + 0.25 ms per token, back to back
    assert clock.slept == pytest.approx([0.00225, 0.00125, 0.00125])


def one_token_plan(llm: LLM) -> tuple:
    """A 1-token step of one request (slot 0) and its sample row."""
    from types import SimpleNamespace

    from minisgl.step.plan import build_step_plan

    pt = np.arange(64, dtype=np.int32).reshape(1, 64)
    one = np.ones(1, dtype=np.int32)
    plan = build_step_plan(pt, np.zeros(1, np.int32), np.zeros(1, np.int32), one,
                           np.array([7], np.int32), one.astype(bool), True)  # fmt: skip
    row = SimpleNamespace(params=SamplingParams(temperature=0), generator=0,
                          input_ids=np.array([7], np.int32), output_ids=[])  # fmt: skip
    return plan, [row]


def test_the_device_time_runs_while_the_host_works(clock, tiny_model_dir):
    """Like a GPU: launching a step costs the host no device time; steps run one after
    another on the device's own timeline; the host waits only when it reads a step's tokens,
    and only for what is left of it."""
    llm = LLM(tiny_model_dir("llama"), sim_device="2,0", overlap=False, **SMALL)
    engine = llm.engine
    step = llm.runtime.device
    plan, rows = one_token_plan(llm)
    a = engine.sample_on_device(plan, rows, step.eos)
    b = engine.sample_on_device(plan, rows, step.eos)
    assert clock.slept == []  # two launches, no wait
    clock.advance(0.0015)  # the host works 1.5 ms meanwhile
    a.result()
    assert clock.slept == pytest.approx([0.0005])  # a ends 2 ms after its launch
    clock.advance(0.003)  # 3 ms of host work: b (2 ms after a) has ended meanwhile
    b.result()
    assert clock.slept == pytest.approx([0.0005])
    c = engine.sample_on_device(plan, rows, step.eos)  # the device is idle: c starts now
    clock.advance(0.0005)
    c.result()
    assert clock.slept == pytest.approx([0.0005, 0.0015])
    llm.close()


def test_the_simulated_device_launches_inline_like_cuda(tiny_model_dir):
    """Overlap on the simulated device needs no host thread: its steps are asynchronous."""
    llm = LLM(tiny_model_dir("llama"), sim_device="0,0", **SMALL)
    assert llm.runtime.depth == 1 and llm.runtime.loop.stream.name == "inline"
    llm.close()


def test_no_weights_are_loaded(tiny_model_dir, monkeypatch):
    import minisgl.engine.engine as real

    def boom(*a, **k):
        raise AssertionError("the simulated device loaded the model")

    monkeypatch.setattr(real, "load_quantized", boom)
    engine = make_engine(EngineConfig(model_path=str(tiny_model_dir("llama")), sim_device="0,0"))
    assert engine.num_pages > 0 and engine.model_config.vocab_size == 384
    with pytest.raises(NotImplementedError):
        engine.forward(None)


@pytest.mark.rust_ext
def test_greedy_outputs_equal_across_backends_and_logprobs(monkeypatch, tiny_model_dir):
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], "hello world", [9] * 40]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    outs = {}
    for backend in ("python", "rust_hotpath"):
        monkeypatch.setenv("MINISGL_CPU_BACKEND", backend)
        llm = LLM(tiny_model_dir("llama"), sim_device="0,0", **SMALL)
        outs[backend] = llm.generate(prompts, params)
    ids = [o["token_ids"] for o in outs["python"]]
    assert ids == [o["token_ids"] for o in outs["rust_hotpath"]]
    assert ids[0] == ids[1] and ids[0] != ids[2]
    assert all(len(t) == 12 for t in ids)
    assert all(o["finish_reason"] == "length" for o in outs["python"])
    lp = outs["python"][0]["logprobs"][0]
    assert lp.token_id == ids[0][0] and lp.logprob == 0.0
    assert [t for t, _ in lp.top] == [ids[0][0], (ids[0][0] + 1) % 384]
