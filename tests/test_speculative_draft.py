"""Issue 62 item 1, second draft source: a draft model sharing the target's tokenizer proposes
its own greedy continuation of each drafting request; the target verifies the drafts in its
verify rows (`tests/test_speculative.py`: one decode row per fed token). Output stays the
target's, token for token (greedy and seeded), whatever the draft proposes; the target
drafting for itself accepts its drafts; every KV page of both engines comes back."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest

from minisgl import LLM, SamplingParams
from minisgl.testing.scenarios import assert_kv_clean, assert_scheduler_clean, random_prompts
from minisgl.testing.tiny_models import write_tiny_model, write_tokenizer

CARD = "P5-002"
RED = "draft-model-tests-fail-before-the-draft-model-source-exists"
GREEN = "draft-model-tests-pass"


def spec_module(name: str = ""):
    """`minisgl.speculative[.<name>]`; its absence fails by assertion (red)."""
    try:
        return importlib.import_module(f"minisgl.speculative{'.' + name if name else ''}")
    except ImportError as exc:
        raise AssertionError(f"no speculative decoding: {exc}") from None


def spec_llm(path, **kwargs) -> LLM:
    try:
        return LLM(path, **kwargs)
    except TypeError as exc:
        raise AssertionError(f"LLM does not take the draft model options: {exc}") from None


def parse_spec(*args):
    try:
        return spec_module().SpecConfig.parse(*args)
    except TypeError as exc:
        raise AssertionError(f"SpecConfig.parse takes no draft model path: {exc}") from None


def drafting(path, k: int = 4, **kw) -> dict:
    return dict(speculative_algorithm="draft", speculative_draft_model_path=str(path),
                speculative_num_draft_tokens=k, **kw)  # fmt: skip


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def draft_source(llm: LLM):
    draft = getattr(llm.scheduler, "draft", None)
    assert draft is not None and hasattr(draft, "propose_many"), draft
    return draft


def assert_draft_clean(llm: LLM) -> None:
    """The draft model's own runtime: nothing in flight, every page free or cached."""
    rt = draft_source(llm).runtime
    assert not rt.has_work()
    assert_scheduler_clean(rt.scheduler)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model("llama", tmp_path_factory.mktemp("tiny-target"), seed=0)


@pytest.fixture(scope="module")
def near(tiny, tmp_path_factory):
    """The target's weights with noise (a tenth of each tensor's spread): a draft that agrees
    with the target often, not always."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tiny-near")
    for f in Path(tiny).iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    gen = torch.Generator().manual_seed(7)
    for f in path.glob("*.safetensors"):
        tensors = load_file(str(f))
        noisy = {
            k: (v + 0.1 * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype)
            if v.ndim > 1 else v
            for k, v in tensors.items()
        }  # fmt: skip
        save_file(noisy, str(f), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """Another architecture with the same tokenizer."""
    return write_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), seed=3)


def _grounded(seed: int, n: int, vocab: int = 300) -> list[int]:
    passage = random_prompts(1, n, n, vocab, seed)[0]
    return passage + passage[: n // 2]


def _reference_and_spec(path, draft, prompts, params, runs=1, **llm_kwargs):
    """Outputs of each run without and with the draft model (same LLM options), both engines'
    KV clean after every run, and the speculative LLM's stats."""
    outs = []
    for spec in ({}, drafting(draft, **llm_kwargs.pop("spec", {}))):
        llm = spec_llm(path, **llm_kwargs, **spec)
        try:
            got = []
            for _ in range(runs):
                got.append([(o["token_ids"], o["text"], o["finish_reason"])
                            for o in llm.generate(prompts, params)])  # fmt: skip
                assert_kv_clean(llm)
                if spec:
                    assert_draft_clean(llm)
            outs.append((got, llm.speculative_stats()))
        finally:
            llm.close()
    (ref, none), (got, stats) = outs
    assert none is None
    return ref, got, stats


# ---------------------------------------------------------------------------- the source
@pytest.mark.card(CARD, "a-draft-model-proposes-its-own-greedy-continuation", RED, GREEN)
def test_a_draft_model_proposes_its_own_greedy_continuation(tiny, near):
    prompts = [random_prompts(1, 20, 20, seed=s)[0] for s in range(3)]
    ref = LLM(near, dtype="float32")
    try:
        want = [ref.generate([p], greedy(5))[0]["token_ids"] for p in prompts]
        grown = prompts[0] + want[0][:2] + [7]  # two drafts accepted, then the target's token
        want_grown = ref.generate([grown], greedy(4))[0]["token_ids"]
    finally:
        ref.close()
    llm = spec_llm(tiny, dtype="float32", **drafting(near, k=5))
    try:
        draft = draft_source(llm)
        got = draft.propose_many([np.array(p, np.int32) for p in prompts], [5, 3, 0])
        assert [g.tolist() for g in got] == [want[0], want[1][:3], []]
        assert all(g.dtype == np.int32 for g in got)
        assert_draft_clean(llm)
        sched = draft.runtime.scheduler
        assert sched.kv_usage()["cached_tokens"] >= 20  # what it computed stays cached
        # the next step's tokens extend the last ones: the cache serves the shared prefix
        assert draft.propose_many([np.array(grown, np.int32)], [4])[0].tolist() == want_grown
        assert_draft_clean(llm)
        assert llm.speculative_stats()["draft_model"] == Path(near).name
    finally:
        llm.close()


@pytest.mark.card(CARD, "the-target-as-its-own-draft-accepts-its-drafts", RED, GREEN)
def test_the_target_as_its_own_draft_accepts_its_drafts(tiny):
    """Every draft is the target's own greedy token, so all are accepted, but near-ties: a row
    of a multi-row GEMM may round apart from a one-row decode in the last bit."""
    prompts = [random_prompts(1, n, n, seed=s)[0] for s, n in ((1, 30), (2, 12), (3, 50))]
    params = [greedy(40), greedy(33), greedy(21)]
    ref, got, stats = _reference_and_spec(
        tiny, tiny, prompts, params, runs=2, dtype="float32",
        spec={"speculative_max_step_rows": 16},
    )  # fmt: skip
    assert got == ref
    assert stats["algorithm"] == "draft" and stats["verify_rows"] > 0, stats
    assert stats["acceptance_rate"] >= 0.95, stats
    assert stats["mean_accepted_length"] >= 4.0, stats  # k = 4: 5 when every draft holds


@pytest.mark.card(
    CARD, "a-different-draft-model-keeps-greedy-and-seeded-output-token-identical", RED, GREEN
)
@pytest.mark.parametrize("which", ["near", "qwen2"])
def test_a_different_draft_model_keeps_the_targets_output(tiny, near, qwen2, which):
    draft = {"near": near, "qwen2": qwen2}[which]
    prompts = [_grounded(1, 40), random_prompts(1, 30, 30, seed=3)[0], [5, 6, 7] * 12,
               _grounded(4, 16), _grounded(5, 24)]  # fmt: skip
    probe = LLM(tiny, dtype="float32")
    text = probe.generate([prompts[0]], greedy(24))[0]["text"]
    probe.close()
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    params = [
        greedy(24, stop=stop),
        greedy(7),  # max_tokens mid-draft
        greedy(60),
        SamplingParams(temperature=0.8, top_p=0.9, seed=12, max_tokens=50, ignore_eos=True,
                       frequency_penalty=0.3),
        SamplingParams(temperature=0.3, seed=11, max_tokens=40, min_tokens=10),
    ]  # fmt: skip
    # two runs on the same LLM: the second hits both prefix caches the first filled
    ref, got, stats = _reference_and_spec(
        tiny, draft, prompts, params, runs=2, dtype="float32", page_size=4, num_pages=1024,
        max_extend_tokens=64,
    )  # fmt: skip
    assert got == ref
    assert ref[0][0][2] == "stop"
    assert stats["verify_rows"] > 0 and stats["drafted_tokens"] > 0, stats
    if which == "near":  # agrees often, not always: both branches of the verify rows ran
        assert 0 < stats["accepted_tokens"] < stats["drafted_tokens"], stats


@pytest.mark.slow
@pytest.mark.card(CARD, "the-embedded-model-drafts-for-itself", RED, GREEN)
def test_the_embedded_model_drafts_for_itself():
    """The embedded model (its default int4 config) as its own draft: the drafts are its greedy
    tokens, accepted but where a verify row's int4 GEMM rounds a near-tie apart from a one-row
    decode."""
    from minisgl.default_model import default_model_path

    chat = [{"role": "user", "content": "Write two sentences about the sea."}]
    llm = spec_llm(None, **drafting(default_model_path()))
    try:
        out = llm.generate([chat], greedy(40))[0]
        stats = llm.speculative_stats()
        assert_kv_clean(llm)
        assert_draft_clean(llm)
    finally:
        llm.close()
    assert len(out["token_ids"]) == 40 and out["text"].strip(), out
    assert stats["verify_rows"] > 0, stats
    assert stats["acceptance_rate"] >= 0.8, stats
    assert stats["mean_accepted_length"] >= 3.0, stats


# ---------------------------------------------------------------------------- interface
@pytest.mark.card(CARD, "draft-model-options-are-checked", RED, GREEN)
def test_draft_model_options_are_checked(tiny, tmp_path):
    config = parse_spec("draft", 3, None, str(tiny))
    assert config.algorithm == "draft" and config.draft_model_path == str(tiny)
    assert config.num_draft_tokens == 3
    assert parse_spec("STANDALONE", None, None, str(tiny)).algorithm == "draft"  # SGLang's name
    assert parse_spec("ngram", 3).draft_model_path is None
    for args, message in [
        (("draft", 4), "speculative_draft_model_path"),
        (("ngram", 4, None, str(tiny)), "speculative_draft_model_path"),
        ((None, None, None, str(tiny)), "speculative_algorithm"),
        (("draft", 4, None, ""), "speculative_draft_model_path"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_spec(*args)
    with pytest.raises(ValueError, match="draft, ngram|ngram, draft"):
        parse_spec("eagle", 4)
    # a draft model that cannot be the target's: missing, a larger vocabulary, another tokenizer
    with pytest.raises((ValueError, OSError), match="nowhere"):
        spec_llm(tiny, **drafting(tmp_path / "nowhere"))
    big = write_tiny_model("llama", tmp_path / "big", seed=1, vocab_size=512)
    with pytest.raises(ValueError, match="vocab"):
        spec_llm(tiny, **drafting(big))
    other = write_tiny_model("llama", tmp_path / "other", seed=1)
    write_tokenizer(other, vocab_size=300)  # the same model size, another tokenizer
    with pytest.raises(ValueError, match="tokenizer"):
        spec_llm(tiny, **drafting(other))
    with pytest.raises(ValueError, match="rust_service"):
        spec_llm(tiny, cpu_backend="rust_service", **drafting(tiny))


@pytest.mark.card(CARD, "server-flags-take-a-draft-model", RED, GREEN)
def test_server_flags_take_a_draft_model(monkeypatch, capsys):
    from minisgl.server.args import parse_args

    monkeypatch.delenv("MINISGL_CPU_BACKEND", raising=False)
    argv = [
        "--model-path",
        "m",
        "--speculative-algorithm",
        "draft",
        "--speculative-draft-model-path",
        "d",
        "--speculative-num-draft-tokens",
        "3",
    ]
    try:
        args = parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(
            f"the server refused the draft model flags (exit {exc.code})"
        ) from None
    kw = args.llm_kwargs()
    assert kw["speculative_algorithm"] == "draft" and kw["speculative_draft_model_path"] == "d"
    assert "speculative_draft_model_path" not in args.engine_kwargs()
    assert parse_args(["--model-path", "m"]).llm_kwargs()["speculative_draft_model_path"] is None
    for bad, message in [
        (["--speculative-algorithm", "draft"], "--speculative-draft-model-path"),
        (["--speculative-algorithm", "ngram", "--speculative-draft-model-path", "d"],
         "--speculative-draft-model-path"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            parse_args(["--model-path", "m", *bad])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.card(CARD, "a-server-with-a-draft-model-serves-the-same-text", RED, GREEN)
def test_a_server_with_a_draft_model_serves_the_same_text(tiny, near, tmp_path):
    import httpx

    from minisgl.testing.server import metric, running_server, wait_kv_clean

    bodies = [
        {"prompt": [5, 6, 7] * 12, "max_tokens": 60, "temperature": 0, "ignore_eos": True},
        {"prompt": _grounded(1, 40), "max_tokens": 50, "temperature": 0, "ignore_eos": True},
    ]
    ref = LLM(tiny, dtype="float32")
    try:
        want = [ref.generate([b["prompt"]], greedy(b["max_tokens"]))[0]["text"] for b in bodies]
    finally:
        ref.close()
    flags = [
        "--dtype",
        "float32",
        "--speculative-algorithm",
        "draft",
        "--speculative-draft-model-path",
        str(near),
        "--speculative-num-draft-tokens",
        "4",
    ]
    env = {"MINISGL_CPU_BACKEND": "python"}
    from minisgl.server.args import parse_args

    try:
        parse_args(["--model-path", str(tiny), *flags])
    except SystemExit as exc:
        raise AssertionError(
            f"the server refused the draft model flags (exit {exc.code})"
        ) from None
    with running_server(tiny, *flags, log_dir=tmp_path, env=env) as server:
        url = server.base_url + "/v1/completions"
        got = [httpx.post(url, json=b, timeout=120).json()["choices"][0]["text"] for b in bodies]
        streamed = []
        with httpx.stream("POST", url, json={**bodies[1], "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])
        assert got == want
        assert "".join(streamed) == want[1]
        text = wait_kv_clean(server)
        assert metric(text, "minisgl_spec_drafted_tokens_total") > 0
        assert metric(text, "minisgl_spec_accepted_tokens_total") > 0


@pytest.mark.card(CARD, "the-offline-harness-runs-a-profile-with-a-draft-model", RED, GREEN)
def test_the_offline_harness_runs_a_profile_with_a_draft_model(tiny, near, tmp_path):
    from minisgl.benchmark import harness

    out = tmp_path / "draft.json"
    argv = ["offline", "--model-path", str(tiny), "--out", str(out), "--no-progress",
            "--profile", "many-short", "--set", "num_requests=4", "--set", "llm.num_pages=2048",
            "--speculative-algorithm", "draft", "--speculative-draft-model-path", str(near),
            "--speculative-num-draft-tokens", "3"]  # fmt: skip
    try:
        rc = harness.main(argv)
    except SystemExit as exc:  # argparse: an unknown flag
        raise AssertionError(f"the harness refused its flags (exit {exc.code})") from None
    assert rc == 0
    record = json.loads(out.read_text())
    spec = record["speculative"]
    assert spec["algorithm"] == "draft" and spec["num_draft_tokens"] == 3, spec
    assert spec["draft_model"] == Path(near).name, spec
    assert spec["drafted_tokens"] > 0, spec
