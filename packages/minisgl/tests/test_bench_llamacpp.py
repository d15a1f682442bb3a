"""The llama.cpp benchmark arm's adapter, driven by a fake `llama_cpp.Llama` (no build needed):
greedy settings, exact token counts past EOS, timing per token, perplexity, the harness's
`--engine llamacpp` and its clear error when llama-cpp-python is not installed."""

from __future__ import annotations

import json
import math
import sys
import types
from typing import ClassVar

import numpy as np
import pytest

from minisgl.benchmark import harness, llamacpp
from minisgl.benchmark.profiles import WorkItem

EOS = 2


class FakeLlama:
    """The surface of `llama_cpp.Llama` the adapter uses; continuation = last token + 1, mod V,
    with an EOS right after the prompt (the arm must not stop there)."""

    vocab = 384
    instances: ClassVar[list[FakeLlama]] = []

    def __init__(self, model_path: str = "", **kwargs) -> None:
        self.model_path, self.kwargs = model_path, kwargs
        self.calls: list[tuple[list[int], dict]] = []
        self.open_generators = 0
        self.scores = np.zeros((0, self.vocab), dtype=np.float32)
        self.input_ids: list[int] = []
        self.evaluated: list[int] = []  # prompt tokens each generate evaluated
        FakeLlama.instances.append(self)

    def generate(self, tokens, reset=True, **kw):
        self.calls.append((list(tokens), dict(kw, reset=reset)))
        # llama-cpp-python keeps the tokens it evaluated last and, even with reset=True,
        # evaluates only what follows their longest common prefix with the new prompt
        same = 0
        for a, b in zip(self.input_ids, tokens, strict=False):
            if a != b:
                break
            same += 1
        same = min(same, len(tokens) - 1)  # its last prompt token is evaluated again
        self.evaluated.append(len(tokens) - same)
        self.input_ids = list(tokens)
        self.open_generators += 1
        try:
            yield EOS
            last = tokens[-1]
            while True:
                last = (last + 1) % self.vocab
                yield last
        finally:
            self.open_generators -= 1

    def reset(self) -> None:
        self.scores = np.zeros((0, self.vocab), dtype=np.float32)
        self.input_ids = []

    def eval(self, tokens) -> None:
        # logits: log-probability 0.5 on the next token of the sequence, uniform elsewhere
        n = len(tokens)
        rest = math.log(0.5 / (self.vocab - 1))
        scores = np.full((n, self.vocab), rest, dtype=np.float32)
        for i in range(n - 1):
            scores[i, tokens[i + 1]] = math.log(0.5)
        self.scores = scores


def test_generate_is_greedy_and_exact_length_past_eos():
    model = FakeLlama()
    assert llamacpp.generate(model, [5, 6, 7], 4) == [EOS, 8, 9, 10]
    assert llamacpp.generate(model, [5], 0) == []
    ((prompt, kw),) = model.calls  # max_tokens=0 never starts a generation
    assert prompt == [5, 6, 7]
    assert kw["temp"] == 0.0 and kw["top_k"] == 1 and kw["repeat_penalty"] == 1.0
    assert kw["reset"] is True
    assert model.open_generators == 0  # closed after the last token: no half-open KV state


def test_every_request_prefills_its_whole_prompt():
    """llama-cpp-python reuses the KV of the prompt it saw last: the benchmark's repeats run the
    same prompts, so a timed single-stream pass skipped llama.cpp's prefill (0.4 against 99 ms
    for 32 tokens, amd-epyc) while minisgl's arm flushes its prefix cache before each pass. The
    arm starts each request from an empty context, as minisgl's does."""
    model = FakeLlama()
    items = [WorkItem(0, [10, 11, 12, 13], 2, arrival_s=0.0)]
    for _ in range(3):  # a warm-up, an untimed and a timed pass over the same workload
        llamacpp.run_llamacpp(model, items)
    assert model.evaluated == [4, 4, 4]
    llamacpp.generate(model, [10, 11, 12, 13, 14], 1)  # a prompt extending the last one too
    assert model.evaluated[-1] == 5


def test_run_llamacpp_times_every_token_in_arrival_order():
    model = FakeLlama()
    items = [
        WorkItem(0, [10, 11, 12], 3, arrival_s=0.2),
        WorkItem(1, [20, 21], 5, arrival_s=0.0),
        WorkItem(2, [30], 1, arrival_s=0.1),
    ]
    done: list[int] = []
    out = llamacpp.run_llamacpp(model, items, progress=done.append)
    m = out["metrics"]
    assert m["num_requests"] == 3 and m["completed"] == 3
    assert m["output_tokens"] == 3 + 5 + 1
    assert m["input_tokens"] == 3 + 2 + 1
    assert [len(t) for t in out["token_times"]] == [3, 5, 1]
    assert [c[0] for c in model.calls] == [[20, 21], [30], [10, 11, 12]]  # arrival order
    flat = sorted(t for ts in out["token_times"] for t in ts)
    assert out["token_times"][1] == sorted(out["token_times"][1])
    assert out["token_times"][1][0] == flat[0]  # the first arrival's tokens come first
    assert m["ttft_ms"]["p50"] is not None and m["tpot_ms"]["p50"] is not None
    assert m["output_tok_s"] == pytest.approx(9 / m["duration_s"])
    assert done == [1, 1, 1]
    assert model.open_generators == 0


def test_perplexity_from_the_scores_of_one_evaluation():
    model = FakeLlama()
    assert llamacpp.perplexity(model, [1, 2, 3, 4, 5]) == pytest.approx(2.0, rel=1e-6)


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    mod = types.ModuleType("llama_cpp")
    mod.Llama = FakeLlama
    mod.__version__ = "0.0-fake"
    mod.llama_print_system_info = lambda: b"AVX2 = 1 | FAKE = 1"
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    FakeLlama.instances.clear()
    return mod


def test_load_passes_threads_and_context(fake_llama_cpp):
    model = llamacpp.load_llamacpp("/x/m.gguf", threads=3, n_ctx=1024, logits_all=True)
    assert model.model_path == "/x/m.gguf"
    kw = model.kwargs
    assert kw["n_threads"] == 3 and kw["n_threads_batch"] == 3
    assert kw["n_ctx"] == 1024 and kw["logits_all"] is True
    assert llamacpp.llamacpp_info() == {"version": "0.0-fake", "system_info": "AVX2 = 1 | FAKE = 1"}


SMALL = ["--set", "num_requests=3", "--set", "output_len=3", "--set", "input_len_min=4"]
SMALL += ["--set", "input_len_max=12", "--set", "warmup_requests=1", "--set", "llm.num_pages=512"]


def test_harness_engine_llamacpp_reports_the_arm_and_ratios(
    fake_llama_cpp, tiny_model_dir, tmp_path
):
    out = tmp_path / "r.json"
    argv = ["offline", "--model-path", str(tiny_model_dir("llama")), "--out", str(out)]
    argv += ["--engine", "llamacpp", "--gguf", str(tmp_path / "m.gguf"), "--threads", "1"]
    rc = harness.main([*argv, "--no-progress", "--repeats", "2", *SMALL])
    assert rc == 0
    data = json.loads(out.read_text())
    lc = data["results"]["llamacpp"]["metrics"]
    assert lc["output_tokens"] == 9 and lc["num_requests"] == 3
    assert len(data["results"]["llamacpp"]["repeats"]) == 2
    assert data["llamacpp"]["gguf"] == "m.gguf" and data["llamacpp"]["threads"] == 1
    (model,) = FakeLlama.instances
    assert model.kwargs["n_threads"] == 1
    assert len(model.calls) == 1 + 2 * 3  # warm-up request, then 2 repeats of 3
    ratio = data["speedup_vs_llamacpp"]["output_tok_s"]
    assert ratio == pytest.approx(
        data["results"]["minisgl"]["metrics"]["output_tok_s"] / lc["output_tok_s"]
    )
    assert "llamacpp.output_tok_s" in data["gate_metrics"]


def test_harness_engine_llamacpp_without_the_package_is_a_usage_error(
    monkeypatch, tiny_model_dir, tmp_path, capsys
):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    argv = ["offline", "--model-path", str(tiny_model_dir("llama")), "--engine", "llamacpp"]
    rc = harness.main([*argv, "--gguf", str(tmp_path / "m.gguf"), "--no-progress", *SMALL])
    assert rc == 2
    err = capsys.readouterr().err
    assert "llama-cpp-python" in err and "GGML_NATIVE=ON" in err
    rc = harness.main([*argv, "--no-progress", *SMALL])  # a --model-path needs its GGUF
    assert rc == 2 and "--gguf" in capsys.readouterr().err


def test_cpu_speed_summary_ratios_and_bounds():
    """cpu_speed's summary: minisgl / llama.cpp and / HF ratios per profile, the bandwidth bound
    of single stream and the GEMM bound of batched profiles (values from a synthetic record)."""
    from minisgl.benchmark.cpu_speed import summarize

    def arm(tok_s, n_in, n_out):
        return {"output_tok_s": tok_s, "input_tokens": n_in, "output_tokens": n_out}

    record = {
        "results": {
            "single": {"minisgl-int4": arm(60.0, 32, 128), "llamacpp": arm(120.0, 32, 128)},
            "seed-offline": {"minisgl-int4": arm(90.0, 100, 100), "hf-fp32": arm(30.0, 100, 100)},
        },
        "bandwidth": {"read_gb_s": 20.0},
        "bytes_per_token": {"int4": 100e6},
        "linear_params": {"layers": 1e8, "lm_head": 2e7},
        "matmul": {"fp32_gflop_s": 100.0, "bf16_gflop_s": 200.0},
    }
    summarize(record)
    assert record["ratios"] == {
        "single.minisgl-int4/llamacpp": 0.5,
        "seed-offline.minisgl-int4/hf-fp32": 3.0,
    }
    bound = record["single_stream_bound"]["int4"]
    assert bound["bandwidth_bound_tok_s"] == pytest.approx(200.0)
    assert bound["fraction_of_bound"] == pytest.approx(0.3)
    c = record["compute_bound"]["seed-offline.minisgl-int4"]
    assert c["gflop_per_output_token"] == pytest.approx(2 * (1e8 * 2 + 2e7) / 1e9)
    assert c["compute_bound_tok_s"] == pytest.approx(200e9 / (2 * (2e8 + 2e7)))
    assert "single.llamacpp" not in record["compute_bound"]
