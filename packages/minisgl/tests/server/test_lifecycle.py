"""Graceful shutdown (SIGINT / SIGTERM), a dying worker, other launch options, the shell."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from minisgl import SamplingParams, ipc
from minisgl.testing.server import running_server


def start_stream(base_url: str, max_tokens: int = 250) -> tuple[threading.Thread, dict]:
    """A long streaming request in a thread; `result` gets its chunks / finish / error."""
    result: dict = {"chunks": 0, "finish": None, "error": None, "started": threading.Event()}

    def run():
        body = {
            "prompt": "long story",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    c = json.loads(line[6:])
                    if "error" in c:
                        result["error"] = c["error"]
                        break
                    result["chunks"] += 1
                    result["started"].set()
                    result["finish"] = c["choices"][0]["finish_reason"] or result["finish"]
        except httpx.HTTPError as e:
            result["error"] = repr(e)
        except Exception as e:  # a chunk the client could not read: never an "ended" request
            result["unreadable"] = repr(e)
        finally:
            result["started"].set()
            result["done"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


@pytest.mark.card(
    "P0-006", "a-server-started-with-transport-generic-answers-like-offline-generation"
)
def test_options_then_sigint_with_request_in_flight(tiny_model_dir, tmp_path, llm_ref):
    """2 tokenizer workers, the generic transport, naive cache, page size 4; then Ctrl+C."""
    flags = ["--num-tokenizer", "2", "--transport", "generic", "--cache-type", "naive",
             "--page-size", "4"]  # fmt: skip
    with running_server(tiny_model_dir("llama"), *flags, log_dir=tmp_path) as s:
        assert set(s.worker_pids()) == {"scheduler", "tokenizer0", "tokenizer1"}
        prompts = ["The quick brown fox", "Paris is", "A radix tree", "Batching helps"]
        want = llm_ref.generate(prompts, SamplingParams(max_tokens=12))
        for p, w in zip(prompts, want, strict=True):  # uids alternate between tokenizers
            r = httpx.post(
                s.base_url + "/v1/completions",
                timeout=60,
                json={"prompt": p, "max_tokens": 12, "temperature": 0},
            )
            assert r.json()["choices"][0]["text"] == w["text"]
        t, res = start_stream(s.base_url)
        assert res["started"].wait(60)
        t0 = time.monotonic()
        code = s.stop(signal.SIGINT)
        t.join(30)
        assert code == 0, s.log()
        # the in-flight request finished or was ended, within the grace period (+ margin)
        assert "unreadable" not in res and (res["finish"] == "length" or res["error"]), res
        log = s.log()  # issue 60: nothing was logged on the signal or while draining
        assert re.search(r"SIGINT received: stopping; draining [01] in-flight requests? ", log), log
        assert re.search(r"drained in \d+\.\ds: ", log), log
        assert res["done"] - t0 < 15
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.base_url + "/health", timeout=2)


def group_processes(pgid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of process group `pgid`."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


@pytest.mark.parametrize("backend", ["python", "rust_service"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_signal_to_the_process_group_drains_like_one_to_the_launcher(
    tiny_model_dir, tmp_path, sig, backend
):
    """systemd (KillMode=control-group), `docker stop` on a shell entrypoint and Ctrl+C signal
    every process of the server, not the launcher alone: the workers must leave the drain to
    the launcher (which stops them after it), not exit at once (the launcher then saw
    'worker tokenizer0 exited with code 0', dropped the in-flight request and exited 1). A
    slowed engine: the 100-token stream is still running when the signal lands. rust_service:
    the Rust service (the control plane) follows the same rule as the Python workers."""
    env = {"MINISGL_FAULT_STEP_DELAY_MS": "20", "MINISGL_CPU_BACKEND": backend}
    flags = ["--shutdown-timeout", "20"]
    with running_server(tiny_model_dir("llama"), *flags, log_dir=tmp_path, env=env) as s:
        pgid = os.getpgid(s.proc.pid)
        assert pgid == s.proc.pid  # its own group (start_new_session)
        workers = set(s.worker_pids().values())
        assert workers <= {p.pid for p in group_processes(pgid)}
        t, res = start_stream(s.base_url, max_tokens=100)
        assert res["started"].wait(60)
        os.killpg(pgid, sig)
        t.join(60)
        code = s.proc.wait(60)
        log = s.log()
        assert "exited with code" not in log, log
        assert res["finish"] == "length" and not res["error"], (res, log)
        name = signal.Signals(sig).name
        assert re.search(rf"{name} received: stopping; draining 1 in-flight request ", log), log
        assert re.search(r"drained in \d+\.\ds: every request finished", log), log
        assert code == 0, log
        deadline = time.monotonic() + 10
        while group_processes(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_processes(pgid), group_processes(pgid)


def test_launcher_killed_mid_drain_leaves_no_worker(tiny_model_dir, tmp_path):
    """The workers ignore a SIGTERM to the group while the launcher drains: `kill -9` of the
    launcher then must still end them (they watch their parent), leaving no orphan."""
    env = {"MINISGL_FAULT_STEP_DELAY_MS": "20"}
    flags = ["--shutdown-timeout", "20"]
    with running_server(tiny_model_dir("llama"), *flags, log_dir=tmp_path, env=env) as s:
        pgid = s.proc.pid
        t, res = start_stream(s.base_url, max_tokens=250)
        assert res["started"].wait(60)
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while "received: stopping" not in s.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "received: stopping" in s.log(), s.log()
        s.proc.kill()
        assert s.proc.wait(10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while group_processes(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_processes(pgid), group_processes(pgid)
        t.join(30)
        assert res["error"], res  # the connection dropped with the launcher
        assert len(ipc.remove_stale_dirs(s.ipc_root)) == 1  # as the next start does


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_dead_worker_fails_health_and_inflight_requests(tiny_model_dir, tmp_path, sig):
    """SIGTERM reaching the engine worker mid-step used to be swallowed (caught as an engine
    error that failed the batch while the worker lived on): it must stop the worker. The engine
    is slowed (250 tokens take >= 5 s) so the stream cannot finish before the signal lands."""
    env = {"MINISGL_FAULT_STEP_DELAY_MS": "20"}
    with running_server(tiny_model_dir("llama"), log_dir=tmp_path, env=env) as s:
        pid = s.worker_pids()["scheduler"]
        t, res = start_stream(s.base_url)
        assert res["started"].wait(60)
        t0 = time.monotonic()
        os.kill(pid, sig)
        t.join(15)
        assert not t.is_alive(), "in-flight request hung after the scheduler died"
        assert res["error"], res
        assert res["done"] - t0 < 5
        h = httpx.get(s.base_url + "/health", timeout=5)
        assert h.status_code == 503 and "scheduler" in h.json()["reason"]
        r = httpx.post(s.base_url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
        assert "retry-after" in r.headers
        m = httpx.get(s.base_url + "/metrics", timeout=5).text
        assert "minisgl_healthy 0" in m
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        # then the launcher drains and exits non-zero (a supervisor restarts it)
        assert s.proc.wait(60) == 1, s.log()


def test_shell_chat_over_stdin(server):
    script = "Hello there\nAnd again\n/reset\nFresh start\n/exit\nnever sent\n"
    p = subprocess.run(
        [sys.executable, "-m", "minisgl.shell", "--base-url", server.base_url,
         "--max-tokens", "8"],
        input=script, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert out.count("assistant> ") == 3
    assert "(history cleared)" in out and out.rstrip().endswith("bye")


def test_help_shows_the_defaults():
    """Issue 60: `python -m minisgl --help` showed no option's default."""
    p = subprocess.run([sys.executable, "-m", "minisgl", "--help"], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    options = {}  # first flag -> its help text, on one line
    for entry in re.split(r"\n  (?=-)", p.stdout.split("\noptions:\n", 1)[1]):
        options[entry.split()[0].rstrip(",")] = " ".join(entry.split())
    for flag, default in [("--port", "1919"), ("--host", "127.0.0.1"), ("--page-size", "1"),
                          ("--max-running-requests", "256"), ("--cache-type", "radix"),
                          ("--max-prefill-length", "4096"), ("--shutdown-timeout", "5"),
                          ("--log-level", "warning"), ("--dtype", "auto")]:  # fmt: skip
        assert re.search(rf"\(default:? {re.escape(default)}\b", options[flag]), options[flag]


def test_requests_running_past_shutdown_timeout_get_503_or_sse_error(tiny_model_dir, tmp_path):
    """SIGTERM with requests that cannot finish within --shutdown-timeout: at its end the
    non-streaming one gets the documented 503 body, the stream an SSE error event, and the
    launcher still exits 0 (a slowed engine: 250 tokens take ~12 s, the timeout is 1 s)."""
    env = {"MINISGL_FAULT_STEP_DELAY_MS": "50"}
    with running_server(
        tiny_model_dir("llama"), "--shutdown-timeout", "1", log_dir=tmp_path, env=env
    ) as s:
        t, res = start_stream(s.base_url)
        plain: dict = {}

        def run_plain():
            body = {"prompt": "long story", "max_tokens": 250, "ignore_eos": True}
            r = httpx.post(s.base_url + "/v1/completions", json=body, timeout=60)
            plain["status"], plain["body"] = r.status_code, r.json()

        tp = threading.Thread(target=run_plain, daemon=True)
        tp.start()
        assert res["started"].wait(60)
        deadline = time.monotonic() + 30
        while s.in_flight() < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        code = s.stop(signal.SIGTERM)
        t.join(30)
        tp.join(30)
        assert code == 0, s.log()
        assert plain.get("status") == 503, plain
        assert plain["body"]["error"]["code"] == "service_unavailable", plain
        assert "shutdown" in plain["body"]["error"]["message"], plain
        assert res["finish"] is None and res["error"], res
        assert res["error"]["code"] == "service_unavailable", res
        assert res["done"] - t0 < 10, res
        # issue 60: nothing was logged on SIGTERM or while draining
        log = s.log()
        start = log.find("SIGTERM received: stopping; draining 2 in-flight requests "
                         "(--shutdown-timeout 1s)")  # fmt: skip
        end = re.search(r"drained in \d+\.\ds: 2 requests ended by --shutdown-timeout 1s", log)
        assert start >= 0 and end and start < end.start(), log


def start_up(model_path: str, *flags: str) -> subprocess.CompletedProcess:
    """`python -m minisgl --model-path PATH` that fails before serving."""
    env = {k: v for k, v in os.environ.items() if k != "MINISGL_LOG_LEVEL"}
    return subprocess.run(
        [sys.executable, "-m", "minisgl", "--model-path", model_path, "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.parametrize("what", ["missing", "gguf", "junk-weights"])
def test_start_up_errors_are_one_line_and_exit_2(tmp_path, tiny_model_dir, what):
    """Issue 60 item 5: a model path that cannot be served (none there, a GGUF file, weights
    that are no safetensors) is one line naming it and saying what to do, exit code 2, no
    traceback; `--log-level debug` shows the traceback."""
    if what == "missing":
        path = tmp_path / "nonexistent"
    elif what == "gguf":
        path = tmp_path / "model.Q4_0.gguf"
        path.write_bytes(b"GGUF" + bytes(60))
    else:
        path = tmp_path / "junk"
        path.mkdir()
        for f in tiny_model_dir("llama").iterdir():
            if f.is_file():
                (path / f.name).write_bytes(f.read_bytes())
        (path / "model.safetensors").write_bytes(b"not a safetensors file")
    done = start_up(str(path))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert 1 <= len(lines) <= 3, done.stderr[-3000:]
    assert str(path) in done.stderr and "Traceback" not in done.stderr
    assert "folder" in done.stderr  # what to do: an HF model folder
    if what == "gguf":
        assert "GGUF version 0" in done.stderr and "GGUF v2/v3 model file" in done.stderr
    debug = start_up(str(path), "--log-level", "debug")
    assert debug.returncode == 2 and "Traceback (most recent call last)" in debug.stderr


def test_a_worker_that_fails_to_start_is_one_error_line_and_exit_2(tmp_path, tiny_model_dir):
    """Issue 60 item 8: a failure only a worker sees (here a model folder without its tokenizer's
    files: the tokenizer worker cannot load it) ends the start with one `minisgl: error:` line
    naming the worker and the error, exit code 2, and no worker's traceback (nor one from a
    worker stopped while it exits) unless `--log-level debug`."""
    path = tmp_path / "no-tokenizer"
    path.mkdir()
    for f in tiny_model_dir("llama").iterdir():
        if f.is_file() and not f.name.startswith("tokenizer"):
            (path / f.name).write_bytes(f.read_bytes())
    done = start_up(str(path))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("minisgl: error:")]
    # the tokenizer worker or the scheduler (which loads the tokenizer too), whichever fails first
    assert len(errors) == 1, done.stderr[-3000:]
    assert re.match(r"minisgl: error: (tokenizer0|scheduler) failed to start: \w+Error: .*tokenizer",
                    errors[0]), errors  # fmt: skip
    debug = start_up(str(path), "--log-level", "debug")
    assert debug.returncode == 2 and "Traceback (most recent call last)" in debug.stderr
