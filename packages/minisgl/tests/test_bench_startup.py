"""`python -m minisgl.benchmark.startup` (issue 35 item 3): each repeat a cold process on empty
caches and a warm one on what it left, the model folder copied so that its packed weights start
cold too; the medians side by side; a failed start or a bad argument is reported, not timed."""

from __future__ import annotations

import json

import pytest

from minisgl.testing.modules import require_module
from minisgl.testing.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model("llama", tmp_path_factory.mktemp("m") / "llama", seed=0)


@pytest.mark.slow
def test_a_cold_start_fills_the_caches_and_a_warm_one_reuses_them(model, tmp_path):
    startup = require_module("minisgl.benchmark.startup")
    out = tmp_path / "startup.json"
    argv = ["--model-path", str(model), "--repeats", "1", "--threads", "1",
            "--set", "quantization=int4", "--set", "dtype=bfloat16", "--out", str(out)]  # fmt: skip
    assert startup.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["kind"] == "startup" and record["machine"]["cpu_kind"]
    kwargs = record["settings"]["llm_kwargs"]
    assert kwargs.pop("model_path").endswith(f"/{model.parent.name}/{model.name}")  # redacted
    assert kwargs == {"threads": 1, "quantization": "int4", "dtype": "bfloat16"}
    cold, warm = record["runs"]
    assert (cold["kind"], warm["kind"]) == ("cold", "warm")
    # the cold run packs the int4 weights and builds the C kernels; the warm one reads them
    assert cold["cache_files_written"] > 0 and warm["cache_files_written"] == 0
    for run in (cold, warm):
        assert run["import_s"] > 0 and run["llm_s"] > 0
        assert run["import_s"] + run["llm_s"] < run["process_s"]
    assert record["summary"]["cold"]["llm_s"] == cold["llm_s"]
    assert record["summary"]["warm"]["process_s"] == warm["process_s"]
    ratio = record["ratios"]["cold_over_warm_process"]
    assert ratio == pytest.approx(cold["process_s"] / warm["process_s"])
    assert not (model / "packed").exists(), "the source folder was packed into"


def test_a_failed_start_is_an_error_naming_the_run(tmp_path):
    startup = require_module("minisgl.benchmark.startup")
    broken = tmp_path / "no-model-here"
    broken.mkdir()  # a folder without config.json: LLM() raises in the child
    with pytest.raises(RuntimeError, match="cold start-up run failed"):
        startup.main(["--model-path", str(broken), "--repeats", "1",
                      "--out", str(tmp_path / "x.json")])  # fmt: skip
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    "bad", [["--repeats", "0"], ["--set", "novalue"], ["--model-path", "/no/such/model"]]
)
def test_bad_arguments_exit_2(bad, tmp_path, capsys):
    startup = require_module("minisgl.benchmark.startup")
    with pytest.raises(SystemExit) as e:
        startup.main([*bad, "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2
    assert bad[0] in capsys.readouterr().err
