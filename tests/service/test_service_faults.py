"""P1-011 faults: a dead service or worker, SIGTERM, garbage on the sockets, a schema version
mismatch at the handshake, disconnects; and what the worker process may import."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgpack
import pytest

from minisgl.testing.server import metric, metrics, start, wait_kv_clean

CARD = "P1-011"
SLOW = {"MINISGL_FAULT_STEP_DELAY_MS": "20"}  # every step 20 ms: streams outlive the faults


def stream_in_thread(base_url: str, out: dict, max_tokens: int = 200) -> threading.Thread:
    """A long stream whose events (and how it ended) land in `out`."""

    def run() -> None:
        body = {"prompt": "once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}  # fmt: skip
        out["events"] = []
        try:
            with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
                out["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        out["events"].append(line[6:])
        except httpx.HTTPError as e:
            out["transport_error"] = repr(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait_tokens(out: dict, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(out.get("events", [])) < n:
        assert time.monotonic() < deadline, f"stream produced {out}"
        time.sleep(0.02)


def ended_with_error(out: dict) -> bool:
    if "transport_error" in out:
        return True
    return any('"error"' in e for e in out.get("events", []))


@pytest.fixture(scope="module")
def shared(tiny_llama, tmp_path_factory):
    """One slowed rust_service server for the tests that leave it serving."""
    log_dir = tmp_path_factory.mktemp("svc-faults")
    with start("svc", tiny_llama, log_dir=log_dir, backend="rust_service", env=SLOW) as s:
        yield s


def wait_health(base_url: str, status: int, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(base_url + "/health", timeout=2)
            if r.status_code == status:
                return r.json()
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"/health never returned {status}"
        time.sleep(0.05)


@pytest.mark.card(CARD, "service-death-worker-death-sigterm")
@pytest.mark.parametrize("victim", ["service", "worker0"])
def test_dead_process_fails_health_and_inflight_requests(tiny_llama, tmp_path, victim):
    with start("svc", tiny_llama, log_dir=tmp_path, backend="rust_service", env=SLOW) as s:
        svc = s.get()
        pid = httpx.get(svc.base_url + "/health").json()["workers"][victim]
        out: dict = {}
        t = stream_in_thread(svc.base_url, out)
        wait_tokens(out, 3)
        os.kill(pid, signal.SIGKILL)
        wait_health(svc.base_url, 503)
        t.join(30)
        assert not t.is_alive(), "the stream hung after its backend died"
        assert ended_with_error(out), out
        assert svc.proc.wait(60) == 1, svc.log()  # the launcher exits 1 after the grace period
        # leaving `start`: no surviving child process and no ipc file (asserted there)


@pytest.mark.card(CARD, "service-death-worker-death-sigterm")
def test_sigterm_stops_everything(tiny_llama, tmp_path):
    with start("svc", tiny_llama, log_dir=tmp_path, backend="rust_service", env=SLOW) as s:
        svc = s.get()
        out: dict = {}
        t = stream_in_thread(svc.base_url, out, max_tokens=240)
        wait_tokens(out, 3)
        svc.proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert not t.is_alive()
        assert svc.proc.wait(30) == 0, svc.log()
        last = [e for e in out["events"] if e != "[DONE]"][-1]
        assert '"error"' in last or '"finish_reason":"length"' in last.replace(" ", ""), last


@pytest.mark.card(CARD, "service-death-worker-death-sigterm")
def test_disconnect_aborts_and_frees_pages(shared):
    svc = shared.get()
    before = metrics(svc)
    body = {"prompt": "abc", "max_tokens": 240, "ignore_eos": True, "stream": True}
    for _ in range(3):
        with httpx.stream("POST", svc.base_url + "/v1/completions", json=body) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i > 4:
                    break  # the client goes away mid-stream
    text = wait_kv_clean(svc, timeout=30)
    aborted = 'minisgl_requests_total{outcome="aborted"}'
    assert metric(text, aborted, default=0) - metric(before, aborted, default=0) == 3


GARBAGE = [
    b"",
    b"\x00",
    b"\xc1",  # never valid msgpack
    msgpack.packb([3]),
    msgpack.packb([99, 1, 5, "text", "hi", []]),  # another schema version
    msgpack.packb([3, 250]),  # unknown tag
    msgpack.packb([3, 1, "uid?", "text", "hi", []]),  # wrong field type
    msgpack.packb([3, 1, 5, "text"]),  # truncated fields
    msgpack.packb({"__type__": "Nope"}),
    msgpack.packb([3, 1, 5, "text", "hi", [1.0] * 40])[:-3],  # truncated bytes
    os.urandom(64),
]


@pytest.mark.card(CARD, "a-malformed-or-truncated-message-on-any-socket-is-logged-and-rejected")
def test_garbage_on_every_socket_is_rejected(shared):
    import zmq

    svc = shared.get()
    (ipc_dir,) = [p for p in Path(svc.ipc_root).iterdir() if p.is_dir()]
    sockets = [p for p in ipc_dir.iterdir() if p.is_socket()]
    assert len(sockets) >= 3, sockets  # frontend, the service's two inboxes, the worker's
    ctx = zmq.Context()
    try:
        for sock_path in sockets:
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(f"ipc://{sock_path}")
            for g in GARBAGE:
                push.send(g)
            push.close()
    finally:
        ctx.term()
    time.sleep(1.0)
    assert httpx.get(svc.base_url + "/health").status_code == 200, svc.log()
    r = httpx.post(svc.base_url + "/v1/completions", timeout=60,
                   json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert "rejected" in svc.log(), svc.log()
    assert "panicked" not in svc.log()
    wait_kv_clean(svc)


@pytest.mark.card(CARD, "typed-transport-with-a-versioned-handshake-that-fails-clearly")
def test_handshake_version_mismatch_fails_clearly(tmp_path):
    import zmq

    from minisgl.cpu_service import service_binary

    ipc_dir = tmp_path / "ipc"
    ipc_dir.mkdir()
    ctx = zmq.Context()
    frontend = ctx.socket(zmq.PULL)
    frontend.bind(f"ipc://{ipc_dir}/frontend")
    proc = subprocess.Popen(
        [
            str(service_binary()),
            "serve",
            "--ipc-dir",
            str(ipc_dir),
            "--model-path",
            str(tmp_path / "no-model-needed-before-the-handshake"),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        push = ctx.socket(zmq.PUSH)
        push.connect(f"ipc://{ipc_dir}/steps")
        push.send(msgpack.packb([99, 12, 0, os.getpid(), {}]))  # WorkerHello from the future
        code = proc.wait(20)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        ctx.destroy(linger=0)
    assert code not in (0, None) and code < 128, code  # an error exit, not a crash
    assert "schema version 99" in err, err
    assert "panicked" not in err


@pytest.mark.card(
    CARD, "no-in-process-ffi-on-the-serving-path", "python-workers-run-the-model-and-sampling-only"
)
def test_worker_imports_no_scheduler_and_no_pyo3():
    code = (
        "import sys, minisgl.server.gpu_worker\n"
        "bad = sorted(m for m in sys.modules if m.startswith('minisgl_cpu') or "
        "(m.startswith('minisgl.scheduler') and m != 'minisgl.step.plan' and "
        "m != 'minisgl.scheduler'))\n"
        "import json; print(json.dumps(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


@pytest.mark.card(CARD, "no-in-process-ffi-on-the-serving-path")
def test_no_pyo3_extension_mapped_in_any_serving_process(shared):
    svc = shared.get()
    pids = httpx.get(svc.base_url + "/health").json()["workers"]
    for pid in [svc.proc.pid, *pids.values()]:
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "minisgl_cpu" not in maps, pid
