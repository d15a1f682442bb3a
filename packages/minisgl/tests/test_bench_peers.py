"""`cpu_speed`'s peers (llama.cpp, vLLM: test_bench_vllm.py) run in processes of their own:
a peer that crashes (SIGSEGV in llama.cpp's AMX path, an abort) is reported as a crash in the
record, with the path it was on, and the run keeps the other arms; a peer is tried on its paths
in order (llama.cpp: its default, then `use_extra_bufts = False`) and measured on the first that
works. Driven by fake peers (`minisgl.testing.peers`) and a fake `llama_cpp` package: no
llama.cpp build, no AMX needed."""

from __future__ import annotations

import json
import textwrap

import pytest

from minisgl.benchmark import cpu_speed
from minisgl.benchmark.peers import PEERS, PeerSpec
from minisgl.testing.cpu_speed import fast_cpu_speed
from minisgl.testing.peers import counting_continuation

OUTPUT_LEN = 8
ARGS = ["--configs", "fp32", "--hf", "", "--profiles", "single", "--repeats", "2"]
ARGS += ["--set", f"single.output_len={OUTPUT_LEN}", "--set", "single.token_id_max=300"]
ARGS += ["--no-quality", "--llamacpp"]


@pytest.fixture
def run(monkeypatch, tiny_model_dir, tmp_path):
    """`cpu_speed.main` with the minisgl arm on a tiny model and the machine's bounds fixed
    (the slow parts of a real run); returns (exit status, record)."""
    fast_cpu_speed(monkeypatch, str(tiny_model_dir("llama")), counting_continuation)

    def go(peers=None, extra=()):
        out = tmp_path / "cpu-speed.json"
        rc = cpu_speed.main(["--out", str(out), *ARGS, *extra], peers=peers)
        return rc, json.loads(out.read_text())

    return go


def fake_llamacpp(**options) -> dict[str, PeerSpec]:
    paths = ("default", "no_extra_bufts")
    return {"llamacpp": PeerSpec("llamacpp", "minisgl.testing.peers:fake_peer", paths, **options)}


def crash(path, phase, signal, exit_code):
    return {"path": path, "phase": phase, "outcome": "crashed", "signal": signal,
            "exit_code": exit_code}  # fmt: skip


def assert_minisgl_measured(record) -> None:
    mini = record["results"]["single"]["minisgl-fp32"]
    assert mini["output_tokens"] == OUTPUT_LEN and mini["output_tok_s"] > 0


def test_a_peer_that_runs_on_its_default_path_is_measured_there(run):
    rc, record = run(fake_llamacpp(options={}))
    assert rc == 0
    assert record["llamacpp_path"] == "default"
    assert record["llamacpp"]["status"] == "ok"
    assert record["llamacpp"]["attempts"] == [{"path": "default", "outcome": "ok"}]
    assert record["llamacpp"]["fake_path"] == "default"  # the peer's own info, from its process
    lc = record["results"]["single"]["llamacpp"]
    assert lc["output_tokens"] == OUTPUT_LEN and len(lc["output_tok_s_per_repeat"]) == 2
    assert_minisgl_measured(record)
    assert "single.minisgl-fp32/llamacpp" in record["ratios"]


def test_a_peer_that_segfaults_on_its_default_path_is_measured_on_the_next(run):
    rc, record = run(fake_llamacpp(options={"crash": {"default": "segv"}}))
    assert rc == 0
    assert record["llamacpp_path"] == "no_extra_bufts"
    assert record["llamacpp"]["attempts"] == [
        crash("default", "probe", "SIGSEGV", -11),
        {"path": "no_extra_bufts", "outcome": "ok"},
    ]
    assert record["llamacpp"]["fake_path"] == "no_extra_bufts"
    lc = record["results"]["single"]["llamacpp"]
    assert lc["output_tokens"] == OUTPUT_LEN and lc["output_tok_s"] > 0
    assert_minisgl_measured(record)


def test_a_peer_that_crashes_on_every_path_reports_each_crash_and_keeps_minisgl(run, capsys):
    rc, record = run(
        fake_llamacpp(options={"crash": {"default": "segv", "no_extra_bufts": "abort"}})
    )
    assert rc == cpu_speed.PEER_FAILED != 0
    assert record["llamacpp_path"] is None
    assert record["llamacpp"]["status"] == "failed"
    assert record["llamacpp"]["attempts"] == [
        crash("default", "probe", "SIGSEGV", -11),
        crash("no_extra_bufts", "probe", "SIGABRT", -6),
    ]
    assert "llamacpp" not in record["results"]["single"]
    assert_minisgl_measured(record)
    err = capsys.readouterr().err
    assert "llamacpp" in err and "SIGSEGV" in err and "SIGABRT" in err


def test_a_peer_that_crashes_while_measured_keeps_the_other_arms(run, capsys):
    """A crash after the probe (in a measured pass) ends the peer for the run: its path and
    phase are recorded, the other arms' numbers kept."""
    rc, record = run(fake_llamacpp(options={"crash": {"default": "exit:7"}, "crash_in": "run"}))
    assert rc == cpu_speed.PEER_FAILED
    assert record["llamacpp"]["status"] == "failed"
    assert record["llamacpp"]["attempts"] == [
        {"path": "default", "outcome": "ok"},
        crash("default", "measure single", None, 7),
    ]
    assert "llamacpp" not in record["results"]["single"]
    assert_minisgl_measured(record)
    assert "exit status 7" in capsys.readouterr().err


# a fake llama-cpp-python: `Llama` reads its model parameters from the ctypes bindings'
# `llama_model_default_params()` as the real one does, and its decode segfaults while
# `use_extra_bufts` is on (llama.cpp's AMX extra buffer type on the Q4_1 GGUF)
FAKE_LLAMA = """
import os, resource, signal
from . import llama_cpp
__version__ = "0.3.36-fake"
def llama_print_system_info():
    return b"AMX_INT8 = 1 | FAKE = 1"
class Llama:
    def __init__(self, model_path, **kwargs):
        self.params = llama_cpp.llama_model_default_params()
    def reset(self):
        pass
    def generate(self, tokens, reset=True, **kw):
        if getattr(self.params, "use_extra_bufts", True):
            resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
            os.kill(os.getpid(), signal.SIGSEGV)
        last = tokens[-1]
        while True:
            last = (last + 1) % 384
            yield last
"""
FAKE_BINDINGS = """
import ctypes
class llama_model_params(ctypes.Structure):
    _fields_ = [("n_gpu_layers", ctypes.c_int32), ("use_mmap", ctypes.c_bool){extra}]
def llama_model_default_params():
    return llama_model_params(n_gpu_layers=0, use_mmap=True{default})
"""


@pytest.fixture
def fake_llama_cpp_package(monkeypatch, tmp_path):
    """Install the fake `llama_cpp` (with or without the `use_extra_bufts` field) for this
    process and the peers' processes."""

    def install(has_field: bool) -> None:
        pkg = tmp_path / "site" / "llama_cpp"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_LLAMA))
        extra = ', ("use_extra_bufts", ctypes.c_bool)' if has_field else ""
        default = ", use_extra_bufts=True" if has_field else ""
        (pkg / "llama_cpp.py").write_text(FAKE_BINDINGS.format(extra=extra, default=default))
        monkeypatch.syspath_prepend(str(pkg.parent))
        monkeypatch.setenv("PYTHONPATH", str(pkg.parent))

    return install


def test_llamacpp_falls_back_to_use_extra_bufts_off_when_its_default_segfaults(
    run, fake_llama_cpp_package
):
    fake_llama_cpp_package(has_field=True)
    rc, record = run()  # the real registry: minisgl.benchmark.llamacpp in its own process
    assert rc == 0
    assert record["llamacpp_path"] == "no_extra_bufts"
    lc = record["llamacpp"]
    assert lc["attempts"] == [
        crash("default", "probe", "SIGSEGV", -11),
        {"path": "no_extra_bufts", "outcome": "ok"},
    ]
    assert lc["use_extra_bufts"] is False and lc["version"] == "0.3.36-fake"
    assert record["results"]["single"]["llamacpp"]["output_tokens"] == OUTPUT_LEN
    assert_minisgl_measured(record)


def test_a_llamacpp_without_the_use_extra_bufts_field_says_so(run, fake_llama_cpp_package):
    fake_llama_cpp_package(has_field=False)
    rc, record = run()
    assert rc == cpu_speed.PEER_FAILED
    first, second = record["llamacpp"]["attempts"]
    assert first == crash("default", "probe", "SIGSEGV", -11)
    assert second["path"] == "no_extra_bufts" and second["outcome"] == "error"
    assert second["phase"] == "load" and "no use_extra_bufts field" in second["error"]
    assert_minisgl_measured(record)


def test_the_llamacpp_peer_is_registered_with_its_two_paths():
    spec = PEERS["llamacpp"]
    assert spec.paths == ("default", "no_extra_bufts") and spec.requires == "llama_cpp"


def test_cpu_speed_llamacpp_without_the_package_is_a_usage_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)  # import fails
    with pytest.raises(SystemExit) as exc:
        cpu_speed.main(["--out", str(tmp_path / "r.json"), *ARGS])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "llama-cpp-python" in err and "GGML_NATIVE=ON" in err
    assert not (tmp_path / "r.json").exists()


def _import_minisgl_then(script: str, **env: str) -> str:
    """`script`'s output in a fresh interpreter that imports minisgl first, with this process's
    environment less the OpenMP variables (and their record) plus `env`."""
    import os
    import subprocess
    import sys

    own = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MINISGL_OPENMP_SET", "MINISGL_OPENMP")
    base = {k: v for k, v in os.environ.items() if k not in own}
    code = f"import os, minisgl\n{script}"
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, check=True,
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip()


PEER_OPENMP = (
    "from minisgl.benchmark.peers import peer_environ\n"
    "e = peer_environ()\n"
    "print(e.get('OMP_WAIT_POLICY'), e.get('GOMP_SPINCOUNT'), e.get('MINISGL_OPENMP'))"
)


def test_a_peer_starts_without_the_openmp_settings_minisgl_made_for_its_own_threads():
    """`import minisgl` makes idle OpenMP threads sleep after a short spin (PASSIVE, 1000), for
    its own engine on a shared machine; a peer is measured as its users run it: llama.cpp links
    libgomp and vLLM's CPU build intel-openmp, whose defaults spin longer (minisgl's own decode
    ran at a third of its speed under PASSIVE alone). Its process gets neither variable, and
    is told not to set them when it imports minisgl itself; what the caller set reaches it."""
    assert _import_minisgl_then(PEER_OPENMP) == "None None keep"
    assert _import_minisgl_then(PEER_OPENMP, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE None keep"
    both = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "50"}
    assert _import_minisgl_then(PEER_OPENMP, **both) == "PASSIVE 50 keep"
    keep = "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    assert _import_minisgl_then(keep, MINISGL_OPENMP="keep") == "None None"


def test_the_peers_process_runs_with_its_librarys_openmp_defaults(run, monkeypatch):
    """End to end: this process imported minisgl (which set and recorded both variables); the
    peer's record says what its process had: neither."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    monkeypatch.setenv("MINISGL_OPENMP_SET", "OMP_WAIT_POLICY,GOMP_SPINCOUNT")
    rc, record = run(fake_llamacpp(options={}))
    assert rc == 0
    assert record["llamacpp"]["openmp_env"] == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the caller's own: the peer gets it
    monkeypatch.delenv("MINISGL_OPENMP_SET")
    rc, record = run(fake_llamacpp(options={}))
    assert record["llamacpp"]["openmp_env"] == {
        "OMP_WAIT_POLICY": "ACTIVE",
        "GOMP_SPINCOUNT": "1000",
    }


def test_a_peer_whose_first_probe_token_is_not_hf_fp32s_is_not_measured(run, monkeypatch, capsys):
    """A peer counts only if it computes the model: its probe's first greedy token on "The
    capital of France is" must be HF fp32's (vLLM 0.32 on a folder whose embedding it left at
    zero decoded token 0 for every prompt, at a plausible speed). The record keeps the probe's
    tokens beside HF's and where they part."""
    rc, record = run(fake_llamacpp(options={}))
    assert rc == 0
    probe = record["llamacpp"]["probe"]
    assert probe["tokens"] == probe["hf_fp32"] and probe["first_divergence"] is None
    assert len(probe["tokens"]) == cpu_speed.PROBE_TOKENS

    monkeypatch.setattr(cpu_speed, "probe_reference", lambda _m, prompt, n: [0] * n)
    rc, record = run(fake_llamacpp(options={}))
    assert rc == cpu_speed.PEER_FAILED
    first, second = record["llamacpp"]["attempts"]
    assert first["path"] == "default" and first["phase"] == "probe"
    assert first["outcome"] == "error" and "not HF fp32's 0" in first["error"]
    assert second["path"] == "no_extra_bufts" and second["outcome"] == "error"
    assert "llamacpp" not in record["results"]["single"]
    assert_minisgl_measured(record)
    assert "not HF fp32's" in capsys.readouterr().err
