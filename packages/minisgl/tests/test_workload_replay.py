"""Workload replay (`minisgl.benchmark.replay`): the golden fixtures give the expected
fingerprint on the Python scheduler and on the Rust binary (`minisgl-cpu-service replay`),
the two reports are identical, bad files fail the same way in both languages, and the
report's checks (pages returned, rejections) can fail."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.benchmark import replay as rp
from minisgl.benchmark.workload import (
    WorkloadError,
    fnv1a64,
    parse_workload,
    synthetic_prompt,
    synthetic_token,
)
from minisgl.cpu_service import service_binary
from minisgl.scheduler.scheduler import Scheduler

FIXTURES = rp.fixtures()
EXPECTED = rp.expected_fingerprints()
MODES = {"fifo": False, "priority": True}
CAP = {"num_pages": 16, "page_size": 4, "prefill_budget": 16, "max_running": 2}


def _write(tmp_path: Path, w: dict[str, Any], name: str = "w.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(w))
    return p


def _rust(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(service_binary()), "replay", *args], capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_fixtures_ship_with_expected_fingerprints():
    assert sorted(FIXTURES) == ["plain", "pressure", "priority"] == sorted(EXPECTED)
    for name, modes in EXPECTED.items():
        assert sorted(modes) == ["fifo", "priority"], name
    # the priority fixture exercises priority: its two modes differ
    assert EXPECTED["priority"]["fifo"] != EXPECTED["priority"]["priority"]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_golden_replay_python_and_rust_service_agree(name, mode):
    prio = MODES[mode]
    py = rp.run_replay(FIXTURES[name], "python", enable_priority=prio)
    rs = rp.run_replay(FIXTURES[name], "rust_service", enable_priority=prio)
    assert (py["backend"], rs["backend"]) == ("python", "rust_service")
    assert py["fingerprint"] == rs["fingerprint"] == EXPECTED[name][mode]
    assert rp.comparable(py) == rp.comparable(rs)
    for report in (py, rs):  # the fingerprint is the documented hash of the tick records
        assert rp.fingerprint(rp.records_of(report)) == report["fingerprint"]
        assert report["pages_returned"] is True and report["drain"]["error"] is None
        assert report["enable_priority"] is prio
        t = report["totals"]
        assert t["finished"] + t["rejected"] == t["requests"]
        assert t["output_tokens"] == sum(r["output_tokens"] for r in report["requests"])
        for r in report["requests"]:
            if r["status"] == "finished":  # no EOS: every request runs to its output_len
                assert r["output_tokens"] == r["output_len"]


def test_fixture_contents_exercise_what_they_name():
    plain = rp.run_replay(FIXTURES["plain"])
    assert plain["totals"]["cached_prompt_tokens"] > 0  # shared system prompt: radix hits
    assert plain["pressure"]["queue_ticks"] == 0 and plain["totals"]["rejected"] == 0
    pressure = rp.run_replay(FIXTURES["pressure"])
    p = pressure["pressure"]
    assert p["queue_slot_ticks"] > 0 and p["queue_kv_ticks"] > 0 and p["kv_ticks"] > 0
    assert p["queue_ticks"] == p["queue_slot_ticks"] + p["queue_kv_ticks"]
    assert pressure["peaks"]["queued"] > 0
    assert pressure["totals"]["cached_prompt_tokens"] > 0
    [rejected] = [r for r in pressure["requests"] if r["status"] == "rejected"]
    assert rejected["id"] == "too-big"
    assert rejected["error"] == "request needs 120 tokens of KV, the pool holds 80"
    assert sum(t["rejected"] == ["too-big"] for t in pressure["ticks"]) == 1


def test_pressure_definitions_on_a_hand_checked_trace(tmp_path):
    """Two slots, 16 pages of 4 tokens: the third request waits for a slot, the fourth for
    KV; the counts follow the documented definitions tick by tick."""
    w = {"capacity": {**CAP, "max_seq_len": 64}, "requests": [
        {"id": "a", "prompt_len": 4, "output_len": 3},
        {"id": "b", "prompt_len": 4, "output_len": 3},
        {"id": "c", "prompt_len": 4, "output_len": 2},
        {"id": "d", "prompt_len": 40, "output_len": 20, "arrival_tick": 3}]}  # fmt: skip
    r = rp.run_replay(_write(tmp_path, w))
    ticks = r["ticks"]
    assert [t["admitted"] for t in ticks[:4]] == [["a", "b"], [], [], ["c"]]
    assert [(t["queued"], t["running"]) for t in ticks[:3]] == [(1, 2)] * 3
    slot = sum(t["queued"] > 0 and t["running"] == 2 for t in ticks)
    kv = sum(t["queued"] > 0 and t["running"] < 2 and t["prefill_tokens"] < 16 for t in ticks)
    assert r["pressure"]["queue_slot_ticks"] == slot == 3
    assert r["pressure"]["queue_kv_ticks"] == kv == 2  # d (15 pages) waits for c to finish
    assert [t["admitted"] for t in ticks[3:6]] == [["c"], [], ["d"]]
    assert r["pressure"]["kv_ticks"] == sum(10 * t["kv_pages"] >= 9 * 16 for t in ticks)
    assert r["peaks"]["queued"] == max(t["queued"] for t in ticks)
    steps = [t for t in ticks if t["kind"] != "idle"]
    assert r["utilisation"]["kv"] == sum(t["kv_pages"] for t in steps) / (len(steps) * 16)
    assert rp.comparable(r) == rp.comparable(rp.run_replay(_write(tmp_path, w), "rust_service"))


@pytest.mark.parametrize("backend", rp.BACKENDS)
def test_a_changed_output_len_changes_the_fingerprint(tmp_path, backend):
    w = json.loads(FIXTURES["plain"].read_text())
    base = rp.run_replay(_write(tmp_path, w, "a.json"), backend)["fingerprint"]
    w["requests"][3]["output_len"] += 1
    assert rp.run_replay(_write(tmp_path, w, "b.json"), backend)["fingerprint"] != base


def test_synthetic_ids_are_pinned():
    """The documented functions (the Rust core's unit test pins the same values)."""
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert synthetic_prompt("a", 3) == [12584, 28051, 16666]
    assert synthetic_token("a", 0) == 23965
    assert all(1 <= t <= 32000 for t in synthetic_prompt("x", 500))


BAD = [
    (lambda w: w["requests"][1].update(output_len=-1),
     "requests[1].output_len: expected an int in [1, 65536], got -1"),
    (lambda w: w["capacity"].pop("page_size"), "capacity.page_size: required field is missing"),
    (lambda w: w["capacity"].update(cache="lru"),
     'capacity.cache: expected "radix" or "naive", got "lru"'),
    (lambda w: w["capacity"].update(num_pages=True),
     "capacity.num_pages: expected an int in [1, 1048576], got true"),
    (lambda w: w["requests"][0].update(prompt_ids=[1, 2]),
     "requests[0]: give exactly one of prompt_ids and prompt_len"),
    (lambda w: w["requests"][0].update(id="b"), 'requests[1].id: duplicate id "b"'),
    (lambda w: w["requests"][1].update(id="a b"),
     'requests[1].id: expected 1 to 64 characters of [A-Za-z0-9._:-], got "a b"'),
    (lambda w: w["requests"][1].update(prompt_len=2.5),
     "requests[1].prompt_len: expected an int in [1, 65536], got 2.5"),
    (lambda w: w["requests"][1].pop("output_len"),
     "requests[1].output_len: required field is missing"),
    (lambda w: w["requests"][0].update(priority=10**7),
     "requests[0].priority: expected an int in [-1000000, 1000000], got 10000000"),
    (lambda w: w["requests"][0].update(arrival_tick=-3),
     "requests[0].arrival_tick: expected an int in [0, 4294967296], got -3"),
    (lambda w: w["requests"][0].update(outputlen=3),
     "requests[0].outputlen: unknown field (expected one of id, prompt_ids, prompt_len, "
     "output_len, priority, arrival_tick)"),
    (lambda w: w.update(requests=[]), "requests: expected a non-empty list, got []"),
    (lambda w: w["requests"].append(7), "requests[2]: expected an object, got 7"),
]  # fmt: skip


@pytest.mark.parametrize(("mutate", "message"), BAD)
def test_bad_workloads_name_the_field_in_both_languages(tmp_path, capsys, mutate, message):
    w = {"capacity": dict(CAP), "requests": [{"id": "a", "prompt_len": 5, "output_len": 2},
                                             {"id": "b", "prompt_len": 3, "output_len": 4}]}  # fmt: skip
    parse_workload(copy.deepcopy(w))  # the unmutated file is valid
    mutate(w)
    with pytest.raises(WorkloadError) as e:
        parse_workload(w)
    assert str(e.value) == message
    path = _write(tmp_path, w)
    out = tmp_path / "r.json"
    assert rp.main(["--input", str(path), "--output", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
    rs = _rust("--input", str(path), "--output", str(out))
    assert rs.returncode == 2, rs.stderr
    assert rs.stderr.strip() == f"error: {message}"
    assert not out.exists()
    with pytest.raises(WorkloadError) as e:
        rp.run_replay(path, "rust_service")
    assert str(e.value) == message


def test_bad_workload_exits_2_without_a_traceback(tmp_path):
    w = {"capacity": dict(CAP), "requests": [{"id": "a", "prompt_len": 5, "output_len": 0}]}
    path = _write(tmp_path, w)
    proc = subprocess.run([sys.executable, "-m", "minisgl.benchmark.replay", "--input",
                           str(path), "--output", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == "error: requests[0].output_len: expected an int in [1, 65536], got 0\n"


@pytest.mark.parametrize("text", ["{", "[1, 2]", ""])
def test_not_a_workload_file(tmp_path, text):
    path = tmp_path / "w.json"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=r"not JSON|workload: expected an object"):
        rp.run_replay(path)
    rs = _rust("--input", str(path), "--output", str(tmp_path / "r.json"))
    assert rs.returncode == 2 and rs.stderr.startswith("error: ")
    assert _rust("--input", str(tmp_path / "missing.json"), "--output", "x").returncode == 2
    assert _rust("--bogus").returncode == 2


def test_pages_returned_check_can_fail(tmp_path, monkeypatch, capsys):
    """A scheduler that leaks one page on release: the report says so and the CLI fails."""
    release = Scheduler._release
    leaked: list[int] = []

    def leaky_release(self, req):
        release(self, req)
        if not getattr(self, "leaked", False):  # one page per scheduler
            self.leaked = True
            leaked.append(self.alloc._free_pages.pop())

    monkeypatch.setattr(Scheduler, "_release", leaky_release)
    path = FIXTURES["plain"]
    report = rp.run_replay(path)
    assert leaked and report["pages_returned"] is False
    assert "owner count" in report["drain"]["error"]
    out = tmp_path / "r.json"
    assert rp.main(["--input", str(path), "--output", str(out)]) == 1
    assert json.loads(out.read_text())["pages_returned"] is False
    assert "KV pages not returned" in capsys.readouterr().err


def test_unwritable_output_is_an_error_not_a_traceback(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "r.json"  # a file where a directory should be
    path = str(FIXTURES["plain"])
    assert rp.main(["--input", path, "--output", str(out)]) == 1
    assert capsys.readouterr().err.startswith(f"error: {out}")
    rs = _rust("--input", path, "--output", str(out))
    assert rs.returncode == 1 and rs.stderr.startswith(f"error: {out}")


def test_cli_writes_the_report_for_both_backends(tmp_path, capsys):
    for backend in rp.BACKENDS:
        out = tmp_path / backend / "r.json"
        argv = ["--input", str(FIXTURES["priority"]), "--output", str(out), "--backend",
                backend, "--enable-priority"]  # fmt: skip
        assert rp.main(argv) == 0
        report = json.loads(out.read_text())
        assert report["backend"] == backend and report["schema"] == rp.SCHEMA
        assert report["fingerprint"] == EXPECTED["priority"]["priority"]
        assert json.loads(capsys.readouterr().out)["fingerprint"] == report["fingerprint"]


# ---------------------------------------------------------------- random workloads
_req = st.fixed_dictionaries(
    {"prompt_len": st.integers(1, 40), "output_len": st.integers(1, 12),
     "priority": st.integers(-3, 3), "arrival_tick": st.integers(0, 12)},
    optional={"shared": st.integers(0, 2)},
)  # fmt: skip


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(reqs=st.lists(_req, min_size=1, max_size=10), num_pages=st.integers(6, 30),
       page_size=st.sampled_from([1, 2, 4]), budget=st.integers(4, 40),
       max_running=st.integers(1, 4), cache=st.sampled_from(["radix", "naive"]),
       aging=st.integers(1, 6), prio=st.booleans(),
       max_seq_len=st.one_of(st.none(), st.integers(4, 48)))  # fmt: skip
def test_random_workloads_agree_across_backends(tmp_path, reqs, num_pages, page_size, budget,
                                                max_running, cache, aging, prio,
                                                max_seq_len):  # fmt: skip
    """Python and the Rust binary agree on every field of random workloads (prefix sharing,
    rejections, context caps, priorities with and without priority scheduling)."""
    stems = [list(range(1, 13)), list(range(50, 58)), [9] * 6]
    out = []
    for i, r in enumerate(reqs):
        d = {"id": f"r{i}", "output_len": r["output_len"], "priority": r["priority"],
             "arrival_tick": r["arrival_tick"]}  # fmt: skip
        if "shared" in r:
            d["prompt_ids"] = stems[r["shared"]] + [100 + i] * (r["prompt_len"] % 5)
        else:
            d["prompt_len"] = r["prompt_len"]
        out.append(d)
    w = {"capacity": {"num_pages": num_pages, "page_size": page_size, "prefill_budget": budget,
                      "max_running": max_running, "cache": cache,
                      "priority_aging_steps": aging}, "requests": out}  # fmt: skip
    if max_seq_len is not None:  # short contexts: rejections and length-capped outputs
        w["capacity"]["max_seq_len"] = max_seq_len
    path = _write(tmp_path, w, f"w{abs(hash(json.dumps(w)))}.json")
    py = rp.run_replay(path, "python", enable_priority=prio)
    rs = rp.run_replay(path, "rust_service", enable_priority=prio)
    assert rp.comparable(py) == rp.comparable(rs)
    assert py["pages_returned"]
