"""The harness writes per-request observations (`--observations`) the release gate joins:
offline on the tiny model and the online A/B's per-arm files (the online run against a real
server is in test_bench_online.py, which shares its server)."""

from __future__ import annotations

import json

import pytest

from cardgate.hardware import hardware_key  # the device: cpu:<kind> here
from cardgate.redact import redact
from minisgl.benchmark import harness, online_ab, release_gate
from minisgl.benchmark.observations import read_jsonl, workload_fingerprint
from minisgl.benchmark.observe import RunLabels, build, kv_peak
from minisgl.benchmark.profiles import WorkItem, build_workload, get_profile

SMALL = ["--set", "num_requests=3", "--set", "output_len=4", "--set", "input_len_min=4",
         "--set", "input_len_max=12", "--set", "warmup_requests=1", "--no-progress"]  # fmt: skip


def test_kv_peak_window():
    samples = [(0.1, 5), (0.2, 9), (0.3, 7), (0.4, 2)]
    assert kv_peak(samples, 0.15, 0.35) == 9
    assert kv_peak(samples, 0.35, 0.5) == 2
    assert kv_peak(samples, 0.0, 0.05) == 5  # nothing in the window: the nearest sample
    assert kv_peak(samples, 0.45, 0.5) == 2  # after the last: the last sample
    assert kv_peak([], 0, 1) is None


def test_build_timings_and_failures():
    items = [WorkItem(0, [1, 2, 3], 3, arrival_s=0.5), WorkItem(1, [4], 3)]
    labels = RunLabels("p", "python", "cpu", "m", "test", repeat=2)
    a, b = build(items, [[0.6, 0.7, 0.9], []], labels, token_ids=[[7, 8, 9], []],
                 kv_samples=[(0.55, 3), (0.8, 6), (1.0, 1)])  # fmt: skip
    assert (a.request_id, a.index, a.repeat) == ("p-0", 0, 2)
    assert a.ttft_s == pytest.approx(0.1) and a.e2e_s == pytest.approx(0.4)
    assert a.itl_s == pytest.approx((0.1, 0.2)) and a.kv_pages_in_use == 6
    assert a.output_token_ids == (7, 8, 9) and a.output_fingerprint.startswith("tokens:")
    assert a.workload_fingerprint == workload_fingerprint([1, 2, 3], 3)
    assert (a.prompt_tokens, a.output_tokens) == (3, 3)
    assert b.error == "no output token" and b.ttft_s is None and b.output_token_ids is None
    assert a.extra["host_cpu"]  # the device is "cpu"; the CPU model rides along


def test_offline_ab_arms_write_their_own_observations():
    args = harness.build_parser().parse_args(["offline", "--ab", "python,rust_hotpath"])
    cmd = harness._arm_command(args, get_profile("seed-offline"), "o.json", "o.python.jsonl")
    assert cmd[cmd.index("--observations") + 1] == "o.python.jsonl"
    assert "--observations" not in harness._arm_command(args, get_profile("seed-offline"), "o")


@pytest.fixture(scope="module")
def offline_obs(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("obs")
    path, out = tmp / "off.jsonl", tmp / "off.json"
    rc = harness.main(
        ["offline", "--model-path", str(tiny_model_dir("llama")), "--out", str(out),
         "--repeats", "2", "--observations", str(path), *SMALL, "--set", "llm.num_pages=512"]
    )  # fmt: skip
    assert rc == 0
    return path, json.loads(out.read_text())


def test_offline_run_writes_observations(offline_obs, tiny_model_dir):
    path, record = offline_obs
    assert record["observations"] == redact(str(path))  # records hold no local path
    observations = read_jsonl(path)
    assert len(observations) == 6  # 3 requests x 2 repeats
    assert [(o.request_id, o.repeat) for o in observations] == [
        (f"seed-offline-{i}", r) for r in (0, 1) for i in range(3)
    ]
    items = build_workload(get_profile("seed-offline", {"num_requests": "3", "output_len": "4",
                           "input_len_min": "4", "input_len_max": "12"}), 384)  # fmt: skip
    for o in observations:
        assert (o.backend, o.device, o.source) == ("python", hardware_key(), "minisgl-offline")
        assert o.model == tiny_model_dir("llama").name and o.error is None
        assert len(o.output_token_ids) == o.output_tokens == 4
        assert o.prompt_tokens == len(items[o.index].prompt_ids)
        assert o.workload_fingerprint == workload_fingerprint(items[o.index].prompt_ids, 4)
        assert 0 < o.ttft_s <= o.e2e_s and len(o.itl_s) == 3
        assert o.e2e_s == pytest.approx(o.ttft_s + sum(o.itl_s))
        assert o.kv_pages_in_use > 0
    first, second = observations[:3], observations[3:]
    assert [o.output_token_ids for o in first] == [o.output_token_ids for o in second]


def test_offline_observations_gate_against_themselves(offline_obs, tmp_path):
    path, _ = offline_obs
    policy = tmp_path / "p.yaml"
    policy.write_text("evidence: {min_matched_requests: 3}\nlatency: {e2e: {max_ratio: null},"
                      " ttft: {max_ratio: null}, itl: {max_ratio: null}, tpot: {max_ratio: null}}\n")  # fmt: skip
    out = tmp_path / "r.json"
    argv = ["--baseline", str(path), "--candidate", str(path), "--policy", str(policy),
            "--out", str(out), "--quiet"]  # fmt: skip
    assert release_gate.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["segments"][0]["summary"]["outputs"]["compared"] == 6
    tampered = tmp_path / "t.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[4]["output_token_ids"][2] += 1
    tampered.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv[3] = str(tampered)
    assert release_gate.main(argv) == 2
    report = json.loads(out.read_text())
    assert report["triage"][0]["examples"] == [
        {"request": "seed-offline-1", "unit": "tokens", "first_divergence": 2}
    ]


def test_online_ab_writes_one_file_per_arm(monkeypatch, tmp_path, tiny_model_dir):
    from test_bench_online_ab import fake_arm

    run = fake_arm([])

    def arm(args, name, profile, log_dir, prog):
        out = run(args, name, profile, log_dir, prog)
        out["model"] = "tiny"
        out["items"] = build_workload(profile, 5000)[:1]
        from minisgl.benchmark.online import StreamOutcome

        text = "same" if name == "python" else "other"
        out["requests"] = [StreamOutcome([0.01, 0.02, 0.03], text, None, 5, 3)]
        out["kv_samples"] = []
        return out

    monkeypatch.setattr(online_ab, "run_arm", arm)
    monkeypatch.setattr(online_ab, "check_server_backend", lambda name: None)
    obs = tmp_path / "F.jsonl"
    rc = harness.main(
        ["online", "--ab", "python,rust_service", "--model-path", str(tiny_model_dir("llama")),
         "--sim-device", "--repeats", "2", "--out", str(tmp_path / "ab.json"),
         "--observations", str(obs), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    data = json.loads((tmp_path / "ab.json").read_text())
    assert data["observations"] == {
        "python": redact(str(tmp_path / "F.python.jsonl")),
        "rust_service": redact(str(tmp_path / "F.rust_service.jsonl")),
    }
    py = read_jsonl(tmp_path / "F.python.jsonl")
    rs = read_jsonl(tmp_path / "F.rust_service.jsonl")
    assert [(o.request_id, o.repeat) for o in py] == [("seed-online-0", 0), ("seed-online-0", 1)]
    assert {o.backend for o in rs} == {"rust_service"} and {o.device for o in rs} == {
        f"sim:{hardware_key()}"
    }
    assert rs[0].output_text == "other"
