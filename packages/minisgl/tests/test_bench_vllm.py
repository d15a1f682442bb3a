"""`cpu_speed --vllm`: vLLM's CPU build as a peer, in a virtualenv of its own (the interpreter
`MINISGL_VLLM_PYTHON` names), on the embedded model's HF folder in bf16. Driven by a fake `vllm`
package that logs what the arm asks of it (no vLLM install, no minutes of start-up): every pass
starts from an empty prefix cache, adds all its requests before the first step (offline, as
the minisgl arm runs), asks exactly `max_tokens` greedy tokens of ids only, and stamps each
token when the step that made it returns."""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap

import pytest

from minisgl.benchmark import cpu_speed, vllm_cpu
from minisgl.benchmark.peers import PEERS
from minisgl.benchmark.profiles import WorkItem
from minisgl.testing.cpu_speed import fast_cpu_speed
from minisgl.testing.peers import counting_continuation

FAKE_VLLM = """
import json, os
__version__ = "0.32.0-fake"
LOG = os.environ.get("FAKE_VLLM_LOG")
MAX_SEQS = 2  # requests decoded together: a pass of 3 needs a second wave

def log(**event):
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps(event) + "\\n")

class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False, detokenize=True,
                 prompt_logprobs=None):
        self.__dict__.update(locals())
        del self.__dict__["self"]

class Logprob:
    def __init__(self, logprob):
        self.logprob = logprob

class Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids

class RequestOutput:
    def __init__(self, request_id, token_ids, prompt_logprobs=None):
        self.request_id, self.outputs = request_id, [Completion(list(token_ids))]
        self.prompt_logprobs = prompt_logprobs

class Engine:
    def __init__(self):
        self.waiting, self.running = [], []
    def add_request(self, rid, prompt, params):
        log(event="add", rid=rid, prompt=prompt["prompt_token_ids"], params=vars(params))
        self.waiting.append([rid, prompt["prompt_token_ids"], params, []])
    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)
    def step(self):
        while self.waiting and len(self.running) < MAX_SEQS:
            self.running.append(self.waiting.pop(0))
        log(event="step", running=[r[0] for r in self.running])
        outs = []
        for req in self.running:
            rid, ids, params, got = req
            got.append(((got or ids)[-1] + 1) % 384)
            lp = None
            if params.prompt_logprobs is not None:
                lp = [None] + [{t: Logprob(-0.5 * (i % 3))} for i, t in enumerate(ids[1:])]
            outs.append(RequestOutput(rid, got, lp))
        self.running = [r for r in self.running if len(r[3]) < r[2].max_tokens]
        return outs

class LLM:
    def __init__(self, model, dtype, max_model_len, seed):
        assert os.path.isfile(os.path.join(model, "config.json")), model
        log(event="load", model=os.path.basename(model), dtype=dtype,
            bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            kv=os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
            omp=os.environ.get("OMP_WAIT_POLICY"))
        self.llm_engine = Engine()
        self.n = 0
    def reset_prefix_cache(self):
        log(event="reset")
        return True
    def generate(self, prompts, params, use_tqdm=True):
        rids = []
        for p, sp in zip(prompts, params):
            self.n += 1
            rids.append(f"g{self.n}")
            self.llm_engine.add_request(rids[-1], p, sp)
        last = {}
        while self.llm_engine.has_unfinished_requests():
            for out in self.llm_engine.step():
                last[out.request_id] = out
        return [last[r] for r in rids]
"""


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """The fake `vllm` package, for this process and the peer's (whose interpreter is this
    one); returns the events it logged, in order."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv(vllm_cpu.PYTHON_ENV, sys.executable)
    logfile = tmp_path / "vllm.log"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(logfile))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)

    def events() -> list[dict]:
        if not logfile.exists():
            return []
        return [json.loads(line) for line in logfile.read_text().splitlines()]

    return events


OUTPUT_LEN = 6
ARGS = ["--configs", "fp32", "--hf", "", "--profiles", "single", "--repeats", "2"]
ARGS += ["--set", f"single.output_len={OUTPUT_LEN}", "--set", "single.token_id_max=300"]
ARGS += ["--no-quality"]


@pytest.fixture
def run(monkeypatch, tiny_model_dir, tmp_path):
    """`cpu_speed.main` with the minisgl arm on a tiny model and the machine's bounds fixed;
    returns (exit status, record)."""
    fast_cpu_speed(monkeypatch, str(tiny_model_dir("llama")), counting_continuation)

    def go(extra=()):
        out = tmp_path / "cpu-speed.json"
        rc = cpu_speed.main(["--out", str(out), *ARGS, *extra])
        return rc, json.loads(out.read_text())

    return go


def passes(events: list[dict]) -> list[list[dict]]:
    """The measured passes' events (from each reset to the next)."""
    out: list[list[dict]] = []
    for e in events:
        if e["event"] == "reset":
            out.append([])
        elif out:
            out[-1].append(e)
    return out


def test_cpu_speed_measures_vllm_in_its_own_interpreter_on_the_models_hf_folder(
    run, fake_vllm, monkeypatch
):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # as `import minisgl` set it, recorded
    monkeypatch.setenv("MINISGL_OPENMP_SET", "OMP_WAIT_POLICY")
    rc, record = run(["--vllm"])
    assert rc == 0
    peer = record["vllm"]
    assert peer["status"] == "ok" and record["vllm_path"] == "bf16"
    assert peer["version"] == "0.32.0-fake" and peer["dtype"] == "bfloat16"
    assert peer["model"] == "SmolLM2-135M-Instruct-f32"
    assert peer["threads"] == record["threads"]
    assert peer["openmp_env"]["OMP_WAIT_POLICY"] is None  # vLLM's own OpenMP defaults
    (load,) = [e for e in fake_vllm() if e["event"] == "load"]
    assert load["dtype"] == "bfloat16" and load["model"] == "SmolLM2-135M-Instruct-f32"
    assert load["bind"] == peer["omp_threads_bind"]
    assert len(load["bind"].split(",")) == min(record["threads"], len(os.sched_getaffinity(0)))
    assert load["omp"] is None and load["kv"] == "4"
    arm = record["results"]["single"]["vllm"]
    assert arm["output_tokens"] == OUTPUT_LEN and len(arm["output_tok_s_per_repeat"]) == 2
    assert "single.minisgl-fp32/vllm" in record["ratios"]


def test_each_pass_starts_from_an_empty_prefix_cache_with_every_request_added_at_once(
    run, fake_vllm
):
    """The passes repeat their prompts: without the reset a timed pass would find its prompts
    cached (the minisgl arm flushes its own). All requests are added before the first step,
    each asking exactly its max_tokens greedy tokens, ids only."""
    rc, _record = run(["--vllm", "--profiles", "seed-offline", "--set", "seed-offline.num_requests=3",
                       "--set", "seed-offline.output_len=5", "--set", "seed-offline.input_len_max=16",
                       "--set", "seed-offline.input_len_min=8",
                       "--set", "seed-offline.token_id_max=300"])  # fmt: skip
    assert rc == 0
    measured = passes(fake_vllm())
    assert len(measured) == 1 + 1 + 2  # the warm-up workload, the untimed pass, 2 repeats
    for events in measured[1:]:
        kinds = [e["event"] for e in events]
        assert kinds[:3] == ["add"] * 3 and "add" not in kinds[3:]
        for add in events[:3]:
            params = add["params"]
            assert params["temperature"] == 0.0 and params["max_tokens"] == 5
            assert params["ignore_eos"] is True and params["detokenize"] is False
    first, again = measured[1][:3], measured[2][:3]
    assert [a["prompt"] for a in first] == [a["prompt"] for a in again]


@pytest.fixture
def folder(tmp_path):
    """An HF folder for the fake to open (it checks for config.json)."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    return str(tmp_path / "hf")


def test_a_pass_stamps_each_token_when_its_step_returns(fake_vllm, folder):
    """Three requests, two decoded at a time (the fake's MAX_SEQS): the third starts after the
    first wave, so its first token comes 4 steps late; every request gets exactly its
    tokens."""
    peer = vllm_cpu.open_peer("bf16", model=folder, threads=1)
    items = [WorkItem(i, [10 + i] * 8, 4) for i in range(3)]
    metrics = peer.run(items)
    assert metrics["output_tokens"] == 12 and metrics["completed"] == 3
    steps = [e for e in fake_vllm() if e["event"] == "step"]
    assert len(steps) == 8  # 4 steps of requests 0 and 1, then 4 of request 2
    assert steps[0]["running"] == steps[3]["running"] != steps[4]["running"]
    assert metrics["ttft_ms"]["max"] > metrics["ttft_ms"]["p50"]


def test_perplexity_comes_from_vllms_prompt_logprobs(fake_vllm, folder):
    peer = vllm_cpu.open_peer("bf16", model=folder, threads=1)
    ids = list(range(100, 110))
    want = math.exp(sum(0.5 * (i % 3) for i in range(9)) / 9)  # the fake's -0.5 * (i % 3)
    assert peer.perplexity(ids) == pytest.approx(want)
    assert peer.generate([[5, 6]], 3) == [[7, 8, 9]]


def test_the_thread_binding_is_the_callers_or_the_first_cpus_of_this_process(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cpus = sorted(os.sched_getaffinity(0))
    assert vllm_cpu.bind_threads(1) == str(cpus[0])
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "3-4")
    assert vllm_cpu.bind_threads(2) == "3-4"


def test_an_unknown_path_is_refused(fake_vllm):
    with pytest.raises(ValueError, match="unknown vLLM path 'fp32'"):
        vllm_cpu.open_peer("fp32", model="/nowhere", threads=1)


def test_cpu_speed_vllm_without_its_interpreter_is_a_usage_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(vllm_cpu.PYTHON_ENV, str(tmp_path / "no-python"))
    with pytest.raises(SystemExit) as exc:
        cpu_speed.main(["--out", str(tmp_path / "r.json"), *ARGS, "--vllm"])
    assert exc.value.code == 2
    assert "nox -s vllm" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_the_vllm_peer_is_registered_with_its_own_interpreter():
    spec = PEERS["vllm"]
    assert spec.paths == ("bf16",) and spec.requires == "vllm"
    assert spec.python_env == "MINISGL_VLLM_PYTHON"
