"""Issue 37, the launch parts: torchrun starts the tensor-parallel ranks (`LLM(tp_size=2)` in a
script, `python -m minisgl --tp 2`) token-identical to tp=1, with ranks > 0 following rank 0 and
a bad world size a clear error before any weight loads; a killed rank ends the run with no
process left; `--dp D --tp T` places replica r's ranks on cuda:{r*T + i} (a pure function here,
a dp=2 x tp=2 server on gloo beside it)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest

from minisgl import LLM, SamplingParams
from minisgl.config import EngineConfig, ModelConfig
from minisgl.testing.modules import require_module
from minisgl.testing.scenarios import random_prompts
from minisgl.testing.server import free_port, start

CARD = "P4-003"
RED = "launch-tests-fail-before-torchrun-launches-and-placement-exist"
GREEN = "launch-tests-pass"
NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
RUN_TIMEOUT_S = 300.0  # two torch imports and a tiny model on a busy 2-core machine

# Run under torchrun: every rank writes its pid, builds the LLM; only rank 0 comes back from
# LLM(...) (ranks > 0 follow rank 0 inside it and exit when rank 0 ends).
SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from minisgl import LLM, SamplingParams

    model, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    rank = os.environ["RANK"]
    with open(os.path.join(out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    llm = LLM(model, tp_size=2, num_pages=2048, max_extend_tokens=24)
    with open(os.path.join(out, f"after{rank}"), "w") as f:
        f.write("returned")
    print("FOLLOWERS " + json.dumps(llm.engine.tp.follower_pids()), flush=True)
    if mode == "generate":
        prompts = json.loads(sys.argv[4])
        params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[5]), ignore_eos=True)
        outs = llm.generate(prompts, params)
        print("TOKENS " + json.dumps([o["token_ids"] for o in outs]), flush=True)
        llm.close()
    else:  # "forever": generate until the group breaks
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2))
        print("READY", flush=True)
        while True:
            llm.generate([[5, 6, 7, 8], [9, 10, 11]], long)
    """
)


def torchrun_env(monkeypatch, rank: int, world: int) -> None:
    """The variables torchrun sets for rank `rank` of `world` on one node."""
    values = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world,
              "GROUP_RANK": 0, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port(),
              "TORCHELASTIC_RUN_ID": "test"}  # fmt: skip
    for key, value in values.items():
        monkeypatch.setenv(key, str(value))


def own_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]  # fmt: skip


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


def assert_gone(pids: list[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids), f"processes left behind: {alive(pids)}"


def script_cmd(tmp_path: Path, *args: str) -> list[str]:
    script = tmp_path / "tp_script.py"
    script.write_text(SCRIPT)
    return [sys.executable, *TORCHRUN, str(script), *args]


def tp1_tokens(path, prompts) -> list[list[int]]:
    llm = LLM(path, num_pages=2048)
    try:
        return [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.close()


def texts(path, ids: list[list[int]]) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    return [tok.decode(t, skip_special_tokens=True) for t in ids]


def post(server, prompt) -> httpx.Response:
    try:
        return httpx.post(server.base_url + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": prompt, "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True})  # fmt: skip
    except httpx.TimeoutException as e:
        raise AssertionError(f"no answer in 120 s ({e}); server log:\n{server.log()}") from e


# ---------------------------------------------------------------------------------- torchrun
@pytest.mark.card(CARD, "a-script-calling-llm-tp-size-2-under-torchrun", RED, GREEN)
def test_torchrun_script_tp2_matches_tp1(tiny_model_dir, tmp_path):
    path = tiny_model_dir("qwen3")
    prompts = random_prompts(4, 2, 40, seed=21)  # several longer than the 24-token chunk
    ref = tp1_tokens(path, prompts)
    cmd = script_cmd(tmp_path, str(path), str(tmp_path), "generate", json.dumps(prompts), str(NEW))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                         start_new_session=True)  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"torchrun exited with {run.returncode}:\n{out[-6000:]}"
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1, f"rank 0 alone prints the outputs:\n{out[-6000:]}"
    assert json.loads(lines[0][len("TOKENS ") :]) == ref
    # rank 1 followed rank 0 inside LLM(...) and exited with it: it never got past the call
    assert (tmp_path / "after0").exists() and not (tmp_path / "after1").exists()
    followers = json.loads(next(x for x in run.stdout.splitlines() if x.startswith("FOLLOWERS "))
                           [len("FOLLOWERS ") :])  # fmt: skip
    assert followers == [int((tmp_path / "pid1").read_text())], "rank 1 is torchrun's process"
    assert "minisgl.engine.follower" not in out  # no rank was spawned besides torchrun's


@pytest.mark.card(CARD, "python-m-minisgl-tp-2-under-torchrun", RED, GREEN)
def test_torchrun_server_tp2(tiny_model_dir, tmp_path):
    path = tiny_model_dir("qwen2")
    prompts = random_prompts(3, 3, 30, seed=11)
    want = texts(path, tp1_tokens(path, prompts))
    flags = ("--tp", "2", "--served-model-name", "m")
    with start("torchrun-tp2", path, *flags, log_dir=tmp_path, backend="python",
               launcher=TORCHRUN) as s:  # fmt: skip
        server = s.get()
        cmds = [" ".join(p.cmdline()) for p in server.children if p.is_running()]
        assert not [c for c in cmds if "minisgl.engine.follower" in c], cmds
        assert sum(" -m minisgl " in f" {c} " for c in cmds) == 2, cmds  # torchrun's 2 ranks
        got = [post(server, p) for p in prompts]
        assert [r.status_code for r in got] == [200] * len(prompts), got[0].text
        assert [r.json()["choices"][0]["text"] for r in got] == want


@pytest.mark.card(
    CARD, "a-world-size-that-is-not-tp-x-dp-or-a-missing-backend-is-a-clear-error-before-any-"
    "weight-loads", RED, GREEN,
)  # fmt: skip
def test_torchrun_bad_settings_fail_before_loading(tiny_model_dir, monkeypatch, capsys):
    launch = require_module("minisgl.distributed.launch")
    import torch.distributed as dist

    import minisgl.engine.engine as engine_mod

    def no_load(*a, **kw):
        raise AssertionError("weights were loaded before the settings were checked")

    monkeypatch.setattr(engine_mod, "load_quantized", no_load)
    path = tiny_model_dir("llama")
    before = {p.pid for p in own_children()}
    cases = [
        (0, 3, 2, r"WORLD_SIZE=3.*tp_size=2"),
        (1, 3, 2, r"WORLD_SIZE=3.*tp_size=2"),
        (0, 2, 1, r"WORLD_SIZE=2.*tp_size=1"),
    ]
    for rank, world, tp, match in cases:
        torchrun_env(monkeypatch, rank, world)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=match):
            LLM(path, tp_size=tp)
        assert time.monotonic() - t0 < 10
    torchrun_env(monkeypatch, 0, 2)
    with monkeypatch.context() as m:
        m.setattr(dist, "is_backend_available", lambda name: False)
        with pytest.raises(ValueError, match=r"gloo.*not available"):
            LLM(path, tp_size=2)
    assert {p.pid for p in own_children()} <= before, "a rank was started for a bad setting"
    # the pure check: WORLD_SIZE is tp x dp, and a torchrun group runs one replica
    env = launch.torchrun_env(dict(os.environ))
    assert env is not None and (env.rank, env.world_size) == (0, 2)
    assert launch.torchrun_env({"PATH": "/bin"}) is None
    launch.check_world(env, tp=2, dp=1)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2.*--tp 1 x --dp 1"):
        launch.check_world(env, tp=1, dp=1)
    with pytest.raises(ValueError, match=r"--dp 2.*torchrun"):
        launch.check_world(env, tp=1, dp=2)
    # the server refuses it while parsing its flags, on every rank, before starting anything
    from minisgl.server.launch import main

    torchrun_env(monkeypatch, 1, 3)
    with pytest.raises(SystemExit):
        main(["--model-path", str(path), "--tp", "2"])
    assert "WORLD_SIZE=3" in capsys.readouterr().err


@pytest.mark.card(CARD, "a-killed-torchrun-rank-ends-every-rank-with-a-clear-error", RED, GREEN)
def test_torchrun_killed_rank_ends_everything(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(script_cmd(tmp_path, str(path), str(tmp_path), "forever"),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    pids: list[int] = []
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while "READY" not in log_path.read_text():
            assert proc.poll() is None, f"torchrun exited early:\n{log_path.read_text()[-6000:]}"
            assert time.monotonic() < deadline, f"never ready:\n{log_path.read_text()[-6000:]}"
            time.sleep(0.2)
        pids = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        rank1 = int((tmp_path / "pid1").read_text())
        followers = next(x for x in log_path.read_text().splitlines() if x.startswith("FOLLOW"))
        assert json.loads(followers.split(" ", 1)[1]) == [rank1], "rank 1 is torchrun's process"
        assert rank1 in pids and int((tmp_path / "pid0").read_text()) in pids
        os.kill(rank1, signal.SIGKILL)
        t0 = time.monotonic()
        code = proc.wait(120)
        assert time.monotonic() - t0 < 90
        out = log_path.read_text()
        assert code != 0, out[-6000:]
        # torchrun names the failed rank and its signal; rank 0 names it if it saw it first
        assert "tensor-parallel rank 1" in out or ("rank" in out and "SIGKILL" in out), out
        assert_gone(pids)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        for pid in alive(pids):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


# ---------------------------------------------------------------------------------- placement
@pytest.mark.card(CARD, "replica-r-s-ranks-run-on-cuda-r-x-t-i", RED, GREEN)
def test_dp_tp_placement(tiny_model_dir):
    place = require_module("minisgl.distributed.placement")
    from minisgl.distributed import check_tp
    from minisgl.distributed.ranks import rank_config

    assert place.placement("auto", dp=2, tp=2, cuda_count=4) == (
        ("cuda:0", "cuda:1"),
        ("cuda:2", "cuda:3"),
    )
    assert place.placement("cuda", dp=2, tp=1, cuda_count=2) == (("cuda:0",), ("cuda:1",))
    assert place.placement("cuda", dp=3, tp=2, cuda_count=8)[2] == ("cuda:4", "cuda:5")
    assert place.placement("cuda:1", dp=1, tp=2, cuda_count=3) == (("cuda:1", "cuda:2"),)
    assert place.placement("auto", dp=2, tp=2, cuda_count=0) == (("cpu", "cpu"),) * 2
    assert place.placement("cpu", dp=2, tp=1, cuda_count=8) == (("cpu",), ("cpu",))
    for r, first in enumerate(("cuda:0", "cuda:2")):  # each replica's rank 0
        assert place.replica_device("auto", replica=r, dp=2, tp=2, cuda_count=4) == first
    with pytest.raises(ValueError, match=r"--dp 2 x --tp 2 needs 4 CUDA devices, 3 visible"):
        place.placement("cuda", dp=2, tp=2, cuda_count=3)
    with pytest.raises(ValueError, match=r"--dp 2 x --tp 2 needs 4 CUDA devices, 3 visible"):
        place.replica_device("auto", replica=0, dp=2, tp=2, cuda_count=3)  # replica 0 too
    with pytest.raises(ValueError, match=r"cuda:1.*4 visible"):
        place.placement("cuda:1", dp=2, tp=2, cuda_count=4)
    # inside a replica: rank i of an engine on cuda:k runs on cuda:k+i
    cfg = EngineConfig(model_path="m", device="cuda:2", tp_size=2)
    assert [rank_config(cfg, i, "cuda").device for i in (0, 1)] == ["cuda:2", "cuda:3"]
    with pytest.raises(ValueError, match=r"tp_size=2 needs 2 CUDA devices from cuda:2, 3 visible"):
        check_tp(ModelConfig.from_dir(tiny_model_dir("llama")), cfg, "cuda", device_count=3,
                 backend_available=lambda name: True)  # fmt: skip


@pytest.mark.card(CARD, "dp-2-x-tp-2-on-gloo-is-token-identical-to-dp-1-tp-1", GREEN)
def test_server_dp2_tp2_on_gloo(tiny_model_dir, tmp_path):
    path = tiny_model_dir("qwen2")
    prompts = random_prompts(4, 3, 30, seed=13)
    want = texts(path, tp1_tokens(path, prompts))
    flags = ("--dp", "2", "--tp", "2", "--threads", "1", "--served-model-name", "m")
    with start("dp2tp2", path, *flags, log_dir=tmp_path, backend="python") as s:
        server = s.get()
        ranks = [p for p in server.children if "minisgl.engine.follower" in
                 " ".join(p.cmdline())]  # fmt: skip
        assert len(ranks) == 2, "one rank process beside each replica's engine"
        got = [post(server, p) for p in prompts]
        assert [r.status_code for r in got] == [200] * len(prompts), got[0].text
        assert [r.json()["choices"][0]["text"] for r in got] == want
        reps = httpx.get(server.base_url + "/health", timeout=10).json()["replicas"]
        assert [r["routed"] > 0 for r in reps] == [True, True], reps
