"""Issue 62, first milestone: n-gram (prompt lookup) speculative decoding on the Python control
plane. Drafts are pure functions of the tokens so far; a verify row feeds k + 1 tokens in one
forward; greedy acceptance keeps the output token-identical to no speculation, and every KV
page comes back after the scenario."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

from minisgl import LLM, SamplingParams
from minisgl.testing.scenarios import assert_kv_clean, assert_scheduler_clean, random_prompts
from minisgl.testing.tiny_models import write_tiny_model

CARD = "P5-001"
RED = "speculative-decoding-tests-fail-before-the-draft-source-exists"
GREEN = "speculative-decoding-tests-pass"


def spec_module(name: str):
    """`minisgl.speculative.<name>`; its absence fails by assertion (red)."""
    try:
        return importlib.import_module(f"minisgl.speculative{'.' + name if name else ''}")
    except ImportError as exc:
        raise AssertionError(f"no speculative decoding yet: {exc}") from None


def spec_llm(path, **kwargs) -> LLM:
    try:
        return LLM(path, **kwargs)
    except TypeError as exc:
        raise AssertionError(f"LLM does not take the speculative options: {exc}") from None


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model("llama", tmp_path_factory.mktemp("tiny-spec"), seed=0)


# ---------------------------------------------------------------------------- draft sources
@pytest.mark.card(CARD, "n-gram-drafts-copy-the-longest-suffix-match", RED, GREEN)
def test_ngram_drafts_copy_the_longest_suffix_match():
    ngram = spec_module("ngram").ngram_draft

    def draft(tokens, k, **kw):
        return ngram(np.array(tokens, dtype=np.int32), k, **kw).tolist()

    # the 3-gram [1, 2, 3] occurred at 0: the tokens after it are copied, up to k
    assert draft([1, 2, 3, 4, 9, 9, 1, 2, 3], 3) == [4, 9, 9]
    assert draft([1, 2, 3, 4, 9, 9, 1, 2, 3], 2) == [4, 9]
    # the longest suffix that matches wins: [2, 3] (-> 8) over [3] (-> 7)
    assert draft([5, 3, 7, 2, 3, 8, 5, 2, 3], 2) == [8, 5]
    # of several occurrences, the latest
    assert draft([1, 2, 1, 3, 1], 2) == [3, 1]
    # a copy stops at the end of the tokens
    assert draft([4, 6, 4], 5) == [6, 4]
    # nothing to copy
    assert draft([1, 2, 3, 4], 3) == []
    assert draft([7], 3) == []
    assert draft([1, 2, 3, 1, 2, 3], 0) == []
    # min_n: a 1-gram match alone is not enough at min_n=2
    assert draft([5, 3, 7, 2, 3], 2, min_n=2) == []
    assert draft([5, 3, 7, 5, 3], 2, min_n=2) == [7, 5]
    # a source from the registry drafts the same
    spec = spec_module("")
    source = spec.make_draft_source(spec.SpecConfig("ngram", 3))
    assert source.propose(np.array([1, 2, 3, 4, 9, 9, 1, 2, 3], np.int32), 3).tolist() == [4, 9, 9]
    assert "ngram" in spec.DRAFT_SOURCES


@pytest.mark.card(CARD, "unknown-algorithms-and-bad-k-are-clear-errors", RED, GREEN)
def test_unknown_algorithms_and_bad_k_are_clear_errors(tiny):
    spec = spec_module("")
    assert spec.SpecConfig.parse(None, None) is None
    assert spec.SpecConfig.parse("ngram", None).num_draft_tokens == spec.DEFAULT_DRAFT_TOKENS
    assert spec.SpecConfig.parse("NGRAM", 5) == spec.SpecConfig("ngram", 5)
    bad = [
        (("eagle", 4), "ngram"),
        (("ngram", 0), "speculative_num_draft_tokens"),
        (("ngram", -2), "speculative_num_draft_tokens"),
        (("ngram", True), "speculative_num_draft_tokens"),
        (("ngram", 2.5), "speculative_num_draft_tokens"),
        (("ngram", spec.MAX_DRAFT_TOKENS + 1), str(spec.MAX_DRAFT_TOKENS)),
        ((None, 4), "speculative_algorithm"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            spec.SpecConfig.parse(*args)
    with pytest.raises(ValueError, match="ngram"):
        spec_llm(tiny, speculative_algorithm="medusa")


# ---------------------------------------------------------------------------- verification
def _spec_scheduler(k: int = 4, page_size: int = 1, max_step_rows: int = 64):
    spec = spec_module("")
    from minisgl.scheduler.backend import SchedulerConfig

    cfg = SchedulerConfig(num_pages=512 // page_size, page_size=page_size, max_seq_len=128,
                          max_running_requests=8, max_extend_tokens=512)  # fmt: skip
    try:
        config = spec.SpecConfig("ngram", k, max_step_rows=max_step_rows)
    except TypeError as exc:
        raise AssertionError(f"SpecConfig has no step budget: {exc}") from None
    return spec_module("scheduler").SpecScheduler.of(cfg, config)


@pytest.mark.card(CARD, "verify-rows-of-different-k-share-one-step", RED, GREEN)
@pytest.mark.parametrize("page_size", [1, 4])
def test_verify_rows_of_different_k_share_one_step(page_size):
    sched = _spec_scheduler(4, page_size)
    a = sched.add_request([10, 11, 12, 13, 14, 10, 11], greedy(20))  # 3-gram match after 12
    b = sched.add_request([20, 21, 22], greedy(20))  # nothing to copy
    c = sched.add_request([30, 31, 32, 33, 34, 35, 30, 31], greedy(3))  # 2 outputs left
    plan, reqs = sched.schedule()
    assert plan.is_prefill
    sched.commit(reqs, plan, [12, 23, 32])
    plan, reqs = sched.schedule()
    # a: [12, 13, 14, 10, 11], b: no draft, c: one draft (two tokens left: one draft + bonus),
    # one decode row per token, row j of a request reading its KV up to its own position
    sa, sb, sc = (sched.requests[r].slot for r in (a, b, c))
    assert not plan.is_prefill
    assert plan.slots.tolist() == [sa] * 5 + [sb] + [sc] * 2
    assert plan.extend_lens.tolist() == [1] * 8
    assert plan.input_ids.tolist() == [12, 13, 14, 10, 11, 23, 32, 33]
    assert plan.positions.tolist() == [7, 8, 9, 10, 11, 3, 8, 9]
    assert plan.seq_lens.tolist() == [8, 9, 10, 11, 12, 4, 9, 10]
    assert plan.sample_rows.tolist() == list(range(8))
    assert plan.logits_indices.tolist() == list(range(8))
    row_a = sched.alloc.page_table[sa]
    assert plan.out_loc[:5].tolist() == row_a[7:12].tolist()
    assert plan.kv_indices[: plan.kv_indptr[2]].tolist() == [*row_a[:8], *row_a[:9]]
    assert [r.rid for r in reqs] == [a] * 5 + [b] + [c] * 2
    # a: 13 and 14 accepted, 99 the target's token where the draft said 10; c: 33 accepted,
    # then its bonus token is its last (max_tokens 3) though more was drafted
    outs = sched.commit(reqs, plan, [13, 14, 99, 5, 6, 24, 33, 44])
    got = {}
    for o in outs:
        got.setdefault(o.rid, []).append((o.token_id, o.finish_reason))
    assert got == {
        a: [(13, None), (14, None), (99, None)],
        b: [(24, None)],
        c: [(33, None), (44, "length")],
    }
    ra, rb = sched.requests[a], sched.requests[b]
    assert ra.output_ids == [12, 13, 14, 99] and ra.kv_len == 7 + 3
    assert rb.output_ids == [23, 24] and rb.kv_len == 4
    assert c not in sched.requests
    sched.check_integrity()
    stats = sched.spec_stats
    assert (stats.verify_rows, stats.drafted_tokens, stats.accepted_tokens) == (2, 5, 3)
    for rid in list(sched.requests):
        sched.abort(rid)
    assert_scheduler_clean(sched)


@pytest.mark.card(
    CARD, "drafts-fit-a-step-budget-given-first-to-the-requests-that-accept-most", GREEN
)
def test_drafts_fit_a_step_budget_given_first_to_the_requests_that_accept_most():
    """A verify row costs arithmetic (the int4 GEMM's cost grows with its rows once the weights
    are read): a step holds at most `max_step_rows` rows, drafts filling what the running
    requests leave, first for the requests whose recent drafts were accepted most; a step
    already full (a large batch) drafts nothing and is a plain decode step."""
    sched = _spec_scheduler(4, max_step_rows=8)
    prompt = [10, 11, 12, 13, 14, 10, 11]
    rids = [sched.add_request(prompt, greedy(30)) for _ in range(3)]
    plan, reqs = sched.schedule()
    sched.commit(reqs, plan, [12] * 3)
    plan, reqs = sched.schedule()  # each proposes [13, 14, 10, 11]: 5 of the 8 rows to share
    lens = [sum(r.rid == rid for r in reqs) for rid in rids]
    assert plan.num_tokens == 8 and sorted(lens) == [1, 2, 5], lens
    # the first request accepts nothing, the others everything: next step the budget is theirs
    tokens = []
    for rid, n in zip(rids, lens, strict=True):
        drafts = [13, 14, 10, 11][: n - 1]
        tokens += [99] * n if rid == rids[lens.index(5)] else [*drafts, 12]
    sched.commit(reqs, plan, tokens)
    plan, reqs = sched.schedule()
    after = [sum(r.rid == rid for r in reqs) for rid in rids]
    assert plan.num_tokens <= 8 and after[lens.index(5)] < 5, (lens, after)
    for rid in list(sched.requests):
        sched.abort(rid)
    assert_scheduler_clean(sched)
    # eight running requests fill the step: no drafts, a plain decode step
    full = _spec_scheduler(4, max_step_rows=8)
    for _ in range(8):
        full.add_request(prompt, greedy(30))
    plan, reqs = full.schedule()
    full.commit(reqs, plan, [12] * 8)
    plan, reqs = full.schedule()
    assert plan.num_tokens == 8 and full.spec_stats.verify_rows == 0
    for rid in list(full.requests):
        full.abort(rid)
    assert_scheduler_clean(full)


@pytest.mark.card(
    CARD, "drafts-fit-a-step-budget-given-first-to-the-requests-that-accept-most", GREEN
)
def test_the_step_budget_is_a_user_option_offline_and_at_the_server(tiny, monkeypatch, capsys):
    """`speculative_max_step_rows` (LLM) / `--speculative-max-step-rows` (server): the budget,
    validated as k is (an int >= 2, and only with an algorithm)."""
    spec = spec_module("")
    try:
        assert spec.SpecConfig.parse("ngram", 3, 12) == spec.SpecConfig("ngram", 3, 12)
    except TypeError as exc:
        raise AssertionError(f"no max_step_rows option: {exc}") from None
    assert spec.SpecConfig.parse("ngram", None, None).max_step_rows == spec.DEFAULT_MAX_STEP_ROWS
    for args, message in [(("ngram", 4, 1), "max_step_rows"), (("ngram", 4, True), "max_step_rows"),
                          ((None, None, 8), "speculative_algorithm")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            spec.SpecConfig.parse(*args)
    llm = spec_llm(tiny, speculative_algorithm="ngram", speculative_max_step_rows=3)
    try:
        assert llm.runtime.scheduler.spec.max_step_rows == 3
    finally:
        llm.close()
    from minisgl.server.args import parse_args

    monkeypatch.delenv("MINISGL_CPU_BACKEND", raising=False)
    try:
        args = parse_args(["--model-path", "m", "--speculative-algorithm", "ngram",
                           "--speculative-max-step-rows", "16"])  # fmt: skip
    except SystemExit as exc:
        raise AssertionError(f"the server refused --speculative-max-step-rows ({exc})") from None
    assert args.llm_kwargs()["speculative_max_step_rows"] == 16
    assert "speculative_max_step_rows" not in args.engine_kwargs()
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model-path", "m", "--speculative-algorithm", "ngram",
                    "--speculative-max-step-rows", "1"])  # fmt: skip
    assert exc.value.code == 2 and "max_step_rows" in capsys.readouterr().err


@pytest.mark.card(CARD, "sampled-rows-draft-with-the-draws-of-their-own-positions", GREEN)
def test_sampled_rows_draft_with_the_draws_of_their_own_positions():
    """A drafting request's verify row j is what the sampler reads at output position
    len(outputs) + j: its outputs extended by the drafts before it (the draw's step, penalties'
    counts, min_tokens), rows with logprobs or a grammar too, each view saying how many of its
    outputs are drafts. A request with one token of room left feeds one token."""
    sched = _spec_scheduler(4)
    prompt = [10, 11, 12, 13, 14, 10, 11]
    drafting = [
        greedy(9),
        SamplingParams(temperature=0.7, seed=1, max_tokens=9),
        greedy(9, min_tokens=3),
        greedy(9, presence_penalty=0.5),
        greedy(9, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=9, response_format={"type": "json_object"}),
    ]
    plain = [greedy(2)]
    for p in [*drafting, *plain]:
        sched.add_request(prompt, p)
    plan, reqs = sched.schedule()
    sched.commit(reqs, plan, [12] * (len(drafting) + len(plain)))
    plan, rows = sched.schedule()
    assert len(rows) == plan.num_tokens == 5 * len(drafting) + len(plain)
    want = [[12], [12, 13], [12, 13, 14], [12, 13, 14, 10], [12, 13, 14, 10, 11]]
    for k, p in enumerate(drafting):
        mine = rows[5 * k : 5 * k + 5]
        assert [list(r.output_ids) for r in mine] == want, p
        assert [r.drafts for r in mine] == [0, 1, 2, 3, 4], p
        assert {r.rid for r in mine} == {mine[0].rid} and all(r.params == p for r in mine)
        assert len({r.generator for r in mine}) == 1
    tail = rows[5 * len(drafting) :]
    assert [r.params for r in tail] == plain and [list(r.output_ids) for r in tail] == [[12]]
    assert tail[0] is sched.requests[tail[0].rid]  # its own row: no drafts
    for rid in list(sched.requests):
        sched.abort(rid)
    assert_scheduler_clean(sched)


# ---------------------------------------------------------------------------- token identity
def _reference_and_spec(path, prompts, params, runs=1, **llm_kwargs):
    """Outputs of each run without and with speculation (same LLM options), each LLM's KV
    clean after every run, and the speculative LLM's stats."""
    outs = []
    for spec in ({}, {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}):
        llm = spec_llm(path, **llm_kwargs, **spec)
        try:
            got = []
            for _ in range(runs):
                got.append([(o["token_ids"], o["text"], o["finish_reason"])
                            for o in llm.generate(prompts, params)])  # fmt: skip
                assert_kv_clean(llm)
            outs.append((got, llm.speculative_stats()))
        finally:
            llm.close()
    (ref, none), (got, stats) = outs
    assert none is None
    return ref, got, stats


def _grounded(seed: int, n: int, vocab: int = 300) -> list[int]:
    """A prompt that repeats a passage: a model copying it gets n-gram drafts accepted."""
    passage = random_prompts(1, n, n, vocab, seed)[0]
    return passage + passage[: n // 2]


@pytest.mark.card(
    CARD, "on-a-tiny-model-with-stop-strings-max-tokens-mid-draft-and-prefix-hits", RED, GREEN
)
@pytest.mark.card(CARD, "every-kv-page-returns-after-speculative-scenarios", RED, GREEN)
@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_output_is_token_identical_on_a_tiny_model(tiny, page_size):
    prompts = [_grounded(1, 40), _grounded(2, 24), random_prompts(1, 30, 30, seed=3)[0],
               [5, 6, 7] * 12, _grounded(4, 16)]  # fmt: skip
    kw = dict(dtype="float32", page_size=page_size, num_pages=4096 // page_size,
              max_extend_tokens=64)  # fmt: skip
    probe = LLM(tiny, **kw)
    text = probe.generate([prompts[0]], greedy(24))[0]["text"]
    probe.close()
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    # a random tiny model seldom agrees with a copy: long outputs get some drafts accepted
    params = [greedy(24, stop=stop), greedy(7), greedy(100), greedy(90),
              SamplingParams(temperature=0.8, seed=5, max_tokens=12)]  # fmt: skip
    # two runs on the same LLM: the second hits the prefix cache the first filled
    ref, got, stats = _reference_and_spec(tiny, prompts, params, runs=2, **kw)
    assert got == ref
    assert ref[0][0][2] == "stop"
    assert stats["verify_rows"] > 0 and stats["accepted_tokens"] > 0, stats


@pytest.mark.card(CARD, "seeded-sampled-output-is-token-identical-to-no-speculation", GREEN)
@pytest.mark.card(CARD, "every-kv-page-returns-after-speculative-scenarios", RED, GREEN)
def test_seeded_sampled_output_is_token_identical_on_a_tiny_model(tiny):
    """Each verify row draws with its own position's noise (and penalties over the outputs
    before it), so a seeded sampled request gives the tokens it gives without speculation:
    the target distribution, exactly."""
    prompts = [_grounded(1, 40), _grounded(2, 24), [5, 6, 7] * 12, _grounded(4, 16)]
    params = [
        SamplingParams(temperature=0.3, seed=11, max_tokens=100, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=12, max_tokens=60, ignore_eos=True,
                       frequency_penalty=0.3),
        SamplingParams(temperature=0.2, top_k=5, seed=13, max_tokens=90, min_tokens=20),
        SamplingParams(temperature=0.5, seed=14, max_tokens=80, repetition_penalty=1.1,
                       ignore_eos=True),
    ]  # fmt: skip
    kw = dict(dtype="float32", max_extend_tokens=64)
    ref, got, stats = _reference_and_spec(tiny, prompts, params, runs=2, **kw)
    assert got == ref
    assert stats["verify_rows"] > 0 and stats["accepted_tokens"] > 0, stats


LOGPROBS_ITEM = "rows-with-logprobs-draft-and-give-the-logprobs-of-no-speculation"
LOGPROBS_RED = "failing-tests-logprob-rows-draft"


@pytest.mark.card(CARD, LOGPROBS_ITEM)
@pytest.mark.card(CARD, LOGPROBS_RED)
def test_rows_with_logprobs_draft_and_give_the_logprobs_of_no_speculation(tiny):
    """Requests with logprobs (greedy and seeded sampled, top 0 / 1 / 3) draft like any other
    row: the same tokens as without speculation, and each token's logprob and top list those of
    the verify row that sampled it (within 1e-5 at fp32: a verify step batches more rows)."""
    prompts = [_grounded(1, 40), [5, 6, 7] * 12, _grounded(4, 16)]
    params = [greedy(80, logprobs=0), greedy(60, logprobs=3),
              SamplingParams(temperature=0.4, seed=21, max_tokens=70, ignore_eos=True,
                             logprobs=1)]  # fmt: skip
    runs = []
    for spec in ({}, {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}):
        llm = spec_llm(tiny, dtype="float32", max_extend_tokens=64, **spec)
        try:
            runs.append((llm.generate(prompts, params), llm.speculative_stats()))
            assert_kv_clean(llm)
        finally:
            llm.close()
    (ref, _), (got, stats) = runs
    assert stats["verify_rows"] > 0 and stats["accepted_tokens"] > 0, stats
    for want, have in zip(ref, got, strict=True):
        assert have["token_ids"] == want["token_ids"]
        assert len(have["logprobs"]) == len(have["token_ids"])
        for a, b in zip(want["logprobs"], have["logprobs"], strict=True):
            assert b.token_id == a.token_id
            assert b.logprob == pytest.approx(a.logprob, abs=1e-5)
            assert [t for t, _ in b.top] == [t for t, _ in a.top]
            assert [v for _, v in b.top] == pytest.approx([v for _, v in a.top], abs=1e-5)


GRAMMAR_ITEM = "rows-with-a-grammar-draft-and-give-the-tokens-of-no-speculation"
GRAMMAR_RED = "failing-tests-grammar-rows-draft"
AB = {"type": "regex", "regex": "[ab]{24,60}"}


def _draft_row(rid: int, params: SamplingParams, outputs: tuple, drafts: int):
    """A verify row whose last `drafts` outputs are drafts (`SampleView.drafts`)."""
    from minisgl.scheduler.backend import SampleView

    try:
        return SampleView(rid, params, 0, np.arange(1, 5, dtype=np.int32), outputs,
                          drafts=drafts)  # fmt: skip
    except TypeError as exc:
        pytest.fail(f"a sample row does not say how many of its outputs are drafts: {exc}")


@pytest.mark.card(CARD, GRAMMAR_ITEM)
@pytest.mark.card(CARD, GRAMMAR_RED)
def test_the_grammar_masks_each_verify_row_after_the_drafts_before_it(tiny):
    """Verify row j of a constrained request is masked as if its j drafts had been sampled; a
    row past a draft the grammar rejects may sample anything (its token is never kept: the
    draft cannot equal a masked draw), without failing the request; the next step's outputs
    (fewer than the drafts consumed) mask as a fresh matcher fed them; a rejected token among
    the request's own outputs still fails its row."""
    from minisgl.config import ModelConfig
    from minisgl.structured import GrammarBank

    vocab = ModelConfig.from_dir(tiny).vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=40, response_format=AB)
    fmt = params.response_format
    a, b, bang = 67, 68, 3  # "a", "b", "!" in the tiny tokenizer

    def fresh(outputs: tuple) -> np.ndarray:
        return GrammarBank(tiny, vocab).allowed([_draft_row(9, params, outputs, 0)], [fmt])[0]

    bank = GrammarBank(tiny, vocab)
    out, drafts = (a, b), (a, bang, b)
    rows = [_draft_row(1, params, out + drafts[:j], j) for j in range(4)]
    masks = bank.allowed(rows, [fmt] * 4)
    assert masks[0][a] and masks[0][b] and not masks[0][bang]
    np.testing.assert_array_equal(masks[0], fresh(out))
    np.testing.assert_array_equal(masks[1], fresh((*out, a)))
    assert masks[2].all() and masks[3].all()  # past the rejected "!": a don't-care row
    # the step kept "a" and sampled "b": the matcher rolls back past the drafts it consumed
    nxt = bank.allowed([_draft_row(1, params, (*out, a, b), 0)], [fmt])[0]
    np.testing.assert_array_equal(nxt, fresh((*out, a, b)))
    bad = bank.allowed([_draft_row(2, params, (a, bang), 0)], [fmt])[0]
    assert not bad.any()  # a real output the grammar rejects: the sampler fails this row


@pytest.mark.card(CARD, GRAMMAR_ITEM)
@pytest.mark.card(CARD, GRAMMAR_RED)
def test_rows_with_a_grammar_draft_and_give_the_tokens_of_no_speculation(tiny):
    """Constrained requests (a regex over two letters, greedy and seeded sampled) draft: the
    same tokens and text as without speculation, with drafts verified and accepted."""
    prompts = [_grounded(1, 40), [67, 68, 67, 3, 3, 68] * 6, _grounded(4, 16)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, response_format=AB),
        SamplingParams(temperature=0.0, max_tokens=40, response_format=AB),
        SamplingParams(temperature=0.5, seed=3, max_tokens=50, response_format=AB),
    ]
    ref, got, stats = _reference_and_spec(tiny, prompts, params, dtype="float32")
    assert got == ref
    assert stats["verify_rows"] > 0 and stats["accepted_tokens"] > 0, stats


OVERLAP_ITEM = "overlap-scheduling-runs-with-speculation"
OVERLAP_RED = "failing-tests-overlap-with-speculation"


def _ahead(sched):
    try:
        return sched.schedule_ahead()
    except RuntimeError as exc:
        pytest.fail(f"the speculative scheduler has no pipelined mode: {exc}")


@pytest.mark.card(CARD, OVERLAP_ITEM)
@pytest.mark.card(CARD, OVERLAP_RED)
def test_a_step_ahead_drafts_only_with_nothing_in_flight():
    """Pipelined: a step is drafted for only when nothing is in flight (its drafts need the
    last token); a verify step in flight is committed before the next is planned. With a plain
    step in flight, a request that would draft (an n-gram match in the tokens it knows) makes
    `schedule_ahead` wait for the commit; requests with nothing to copy get a plain step ahead,
    overlapped with the one in flight."""
    sched = _spec_scheduler(4)
    a = sched.add_request([10, 11, 12, 13, 14, 10, 11], greedy(20))  # "10 11" recurs
    first = _ahead(sched)
    assert first.plan.is_prefill
    assert _ahead(sched) is None  # a would draft: wait for the prefill's token
    assert [o.token_id for o in sched.commit_oldest([12]).outputs] == [12]
    verify = _ahead(sched)
    assert verify.plan.input_ids.tolist() == [12, 13, 14, 10, 11]
    assert [r.drafts for r in verify.reqs] == [0, 1, 2, 3, 4]
    assert _ahead(sched) is None and sched.num_inflight == 1  # a verify step: commit it first
    outs = sched.commit_oldest([13, 14, 99, 5, 6]).outputs
    assert [(o.rid, o.token_id) for o in outs] == [(a, 13), (a, 14), (a, 99)]
    assert sched.requests[a].kv_len == 10 and sched.num_inflight == 0
    sched.abort(a)
    b = sched.add_request([20, 21, 22, 23], greedy(5))  # nothing to copy
    assert _ahead(sched).plan.is_prefill
    plain = _ahead(sched)  # overlapped: planned with the prefill in flight
    assert plain is not None and not plain.plan.is_prefill
    assert plain.plan.input_ids.tolist() == [-1]  # the in-flight token
    sched.commit_oldest([24])
    sched.commit_oldest([25])
    assert sched.requests[b].output_ids == [24, 25]
    sched.abort(b)
    assert_scheduler_clean(sched)


@pytest.mark.card(CARD, OVERLAP_ITEM)
def test_an_abort_while_a_verify_step_flies_frees_the_request_at_its_commit():
    """A request aborted (client gone, stop string) while its verify step is in flight keeps
    its KV until the step is committed; the commit drops its rows' tokens and frees it, the
    other request's accepted drafts are kept."""
    sched = _spec_scheduler(4)
    a = sched.add_request([10, 11, 12, 13, 14, 10, 11], greedy(20))
    b = sched.add_request([30, 31, 32, 33, 34, 35, 30, 31], greedy(20))
    assert _ahead(sched).plan.is_prefill
    sched.commit_oldest([12, 32])
    verify = _ahead(sched)
    assert verify.plan.input_ids.tolist() == [12, 13, 14, 10, 11, 32, 33, 34, 35, 30]
    assert sched.abort(a)
    assert a not in sched.requests and sched.num_retiring == 1
    sched.check_integrity()  # a's pages still held: the step in flight reads them
    outs = sched.commit_oldest([13, 14, 10, 11, 7, 33, 34, 0, 0, 0]).outputs
    assert [(o.rid, o.token_id) for o in outs] == [(b, 33), (b, 34), (b, 0)]
    assert sched.num_retiring == 0 and sched.requests[b].output_ids == [32, 33, 34, 0]
    sched.abort(b)
    assert_scheduler_clean(sched)


@pytest.mark.card(CARD, OVERLAP_ITEM)
def test_a_full_step_goes_ahead_without_waiting_for_drafts():
    """As many running requests as `max_step_rows`: no free row for a draft, so a step ahead
    never waits for a commit to draft (and proposes nothing), even where n-grams match."""
    sched = _spec_scheduler(4, max_step_rows=2)
    for _ in range(2):
        sched.add_request([10, 11, 12, 13, 14, 10, 11], greedy(20))  # "10 11" recurs
    calls = []
    propose = sched.draft.propose_many
    sched.draft.propose_many = lambda *a: calls.append(a) or propose(*a)
    assert _ahead(sched).plan.is_prefill
    plain = _ahead(sched)  # overlapped: planned with the prefill in flight
    assert plain is not None and plain.plan.input_ids.tolist() == [-1, -1]
    assert calls == []
    sched.commit_oldest([12, 12])
    sched.commit_oldest([13, 13])
    for rid in list(sched.requests):
        sched.abort(rid)
    assert_scheduler_clean(sched)


@pytest.mark.card(CARD, OVERLAP_ITEM)
@pytest.mark.card(CARD, OVERLAP_RED)
def test_overlap_scheduling_with_speculation_gives_the_serial_loops_tokens(tiny):
    """`overlap=True` with n-gram drafts: greedy, logprob, seeded sampled and constrained rows
    give the tokens (and logprobs) of the serial loop without speculation, drafts accepted, the
    KV clean after the run."""
    prompts = [_grounded(1, 40), [5, 6, 7] * 12, random_prompts(1, 30, 30, seed=3)[0],
               _grounded(4, 16)]  # fmt: skip
    params = [greedy(60), greedy(50, logprobs=2),
              SamplingParams(temperature=0.7, seed=4, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, response_format=AB)]  # fmt: skip
    runs = []
    for kw in ({"overlap": False}, {"overlap": True, "speculative_algorithm": "ngram",
                                    "speculative_num_draft_tokens": 4}):  # fmt: skip
        try:
            llm = LLM(tiny, dtype="float32", max_extend_tokens=64, **kw)
        except ValueError as exc:
            pytest.fail(f"overlap scheduling refused with speculation: {exc}")
        try:
            runs.append((llm.generate(prompts, params), llm.speculative_stats(), llm.runtime.depth))
            assert_kv_clean(llm)
        finally:
            llm.close()
    (ref, _, _), (got, stats, depth) = runs
    assert depth == 1
    assert stats["verify_rows"] > 0 and stats["accepted_tokens"] > 0, stats
    for want, have in zip(ref, got, strict=True):
        assert (have["token_ids"], have["text"]) == (want["token_ids"], want["text"])
        assert have["finish_reason"] == want["finish_reason"]
    for a, b in zip(ref[1]["logprobs"], got[1]["logprobs"], strict=True):
        assert b.token_id == a.token_id and b.logprob == pytest.approx(a.logprob, abs=1e-5)


@pytest.mark.slow
@pytest.mark.card(CARD, "on-the-embedded-model", RED, GREEN)
def test_greedy_output_is_token_identical_on_the_embedded_model():
    passage = (
        "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
        "small brass lamp and a notebook in which he wrote down the colour of the sea, the "
        "direction of the wind and the names of the ships that passed the point."
    )
    prompts = [
        [{"role": "user", "content": f"Repeat this text exactly:\n\n{passage}"}],
        [{"role": "user", "content": f"Copy the text, word for word:\n\n{passage}"}],
        [{"role": "user", "content": "Name three colours."}],
    ]
    params = [greedy(48), greedy(13), SamplingParams(temperature=0.0, max_tokens=24, stop=",")]
    # float weights (quantization="none"): the int4 layers' packed kernel with fp32 activations
    # is torch's scalar fallback (an 8.6 s prefill of this prompt, 118 s for the test)
    ref, got, stats = _reference_and_spec(
        None, prompts, params, dtype="float32", quantization="none"
    )
    assert got == ref
    assert stats["accepted_tokens"] > 10, stats
    assert stats["mean_accepted_length"] > 1.5, stats


@pytest.mark.card(CARD, "acceptance-rate-and-mean-accepted-length-are-reported", RED, GREEN)
def test_acceptance_rate_and_mean_accepted_length_are_reported(tiny):
    llm = spec_llm(tiny, dtype="float32", speculative_algorithm="ngram",
                   speculative_num_draft_tokens=3)  # fmt: skip
    try:
        llm.generate([[5, 6, 7] * 12, _grounded(1, 40)], greedy(30))
        s = llm.speculative_stats()
        run = llm.last_run
    finally:
        llm.close()
    assert s["algorithm"] == "ngram" and s["num_draft_tokens"] == 3
    assert s["verify_rows"] > 0 and 0 < s["drafted_tokens"] <= 3 * s["verify_rows"]
    assert 0 < s["accepted_tokens"] <= s["drafted_tokens"]
    assert s["acceptance_rate"] == pytest.approx(s["accepted_tokens"] / s["drafted_tokens"])
    assert s["mean_accepted_length"] == pytest.approx(1 + s["accepted_tokens"] / s["verify_rows"])
    assert run["spec_acceptance_rate"] == pytest.approx(s["acceptance_rate"])
    assert run["spec_mean_accepted_length"] == pytest.approx(s["mean_accepted_length"])


@pytest.mark.card(CARD, "the-rust-control-plane-is-refused-overlap-follows-its-default", RED, GREEN)
def test_the_rust_control_plane_is_refused_and_overlap_follows_its_default(tiny):
    """The Rust service plans no draft rows yet: refused. Overlap scheduling runs with
    speculation (it was refused until stop 73): on by default as without speculation."""
    from minisgl.runtime.loop import overlap_disabled

    on = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=2)
    with pytest.raises(ValueError, match="rust_service"):
        spec_llm(tiny, cpu_backend="rust_service", **on)
    for overlap, depth in ((None, 0 if overlap_disabled() else 1), (True, 1), (False, 0)):
        llm = spec_llm(tiny, overlap=overlap, **on)
        try:
            assert llm.runtime.depth == depth, overlap
        finally:
            llm.close()


# ---------------------------------------------------------------------------- interface
@pytest.mark.card(CARD, "server-flags-validate-at-start-up", RED, GREEN)
def test_server_flags_validate_at_start_up(monkeypatch, capsys):
    from minisgl.server.args import parse_args

    monkeypatch.delenv("MINISGL_CPU_BACKEND", raising=False)
    args = parse_args(["--model-path", "m", "--speculative-algorithm", "ngram",
                       "--speculative-num-draft-tokens", "5"])  # fmt: skip
    kw = args.llm_kwargs()
    assert kw["speculative_algorithm"] == "ngram" and kw["speculative_num_draft_tokens"] == 5
    assert parse_args(["--model-path", "m"]).llm_kwargs()["speculative_algorithm"] is None
    for argv, message in [
        (["--speculative-algorithm", "eagle"], "ngram"),
        (["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "0"],
         "speculative_num_draft_tokens"),
        (["--speculative-num-draft-tokens", "3"], "speculative_algorithm"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            parse_args(["--model-path", "m", *argv])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()[-1]) > 0, err
    monkeypatch.setenv("MINISGL_CPU_BACKEND", "rust_service")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model-path", "m", "--speculative-algorithm", "ngram"])
    assert exc.value.code == 2
    assert "rust_service" in capsys.readouterr().err


@pytest.mark.card(CARD, "benchmark-prints-both-arms-and-the-ratio", RED, GREEN)
def test_benchmark_prints_both_arms_and_the_ratio(tiny, capsys):
    try:
        bench = importlib.import_module("minisgl.benchmark.speculative")
    except ImportError as exc:
        raise AssertionError(f"no speculative benchmark yet: {exc}") from None
    bench.main(["--model-path", str(tiny), "--repeats", "1", "--max-tokens", "16",
                "--num-draft-tokens", "3", "--dtype", "float32"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["machine"] and report["repeats"] == 1
    assert {w["workload"] for w in report["workloads"]} == {"input_grounded", "random_tokens"}
    for w in report["workloads"]:
        off, on = w["off"], w["on"]
        assert off["output_tok_s"] > 0 and on["output_tok_s"] > 0
        assert w["ratio"] == pytest.approx(on["output_tok_s"] / off["output_tok_s"])
        assert w["token_identical"] is True
        assert 0 <= on["acceptance_rate"] <= 1 and on["mean_accepted_length"] >= 1


@pytest.mark.card(CARD, "acceptance-rate-and-mean-accepted-length-are-reported", RED, GREEN)
def test_metrics_render_the_acceptance():
    from minisgl.server.metrics import Metrics
    from minisgl.testing.server import metric

    spec = {"spec_verify_rows": 4, "spec_drafted_tokens": 10, "spec_accepted_tokens": 6}
    text = Metrics().render(in_flight=0, healthy=True, sched=spec)
    assert metric(text, "minisgl_spec_acceptance_rate") == pytest.approx(0.6)
    assert metric(text, "minisgl_spec_mean_accepted_length") == pytest.approx(2.5)
    assert metric(text, "minisgl_spec_accepted_tokens_total") == 6
    assert "minisgl_spec" not in Metrics().render(in_flight=0, healthy=True, sched={})


@pytest.mark.slow
@pytest.mark.card(CARD, "a-server-with-speculation-serves-the-same-text", RED, GREEN)
def test_a_server_with_speculation_serves_the_same_text(tiny, tmp_path):
    import httpx

    from minisgl.testing.server import metric, running_server, wait_kv_clean

    prompts = [[5, 6, 7] * 12, _grounded(1, 40)]
    bodies = [
        {"prompt": prompts[0], "max_tokens": 80, "temperature": 0, "ignore_eos": True},
        {"prompt": prompts[1], "max_tokens": 70, "temperature": 0, "ignore_eos": True},
    ]
    ref = LLM(tiny, dtype="float32")
    try:
        want = [ref.generate([b["prompt"]], greedy(b["max_tokens"]))[0]["text"] for b in bodies]
    finally:
        ref.close()
    flags = ["--dtype", "float32", "--speculative-algorithm", "ngram",
             "--speculative-num-draft-tokens", "4"]  # fmt: skip
    env = {"MINISGL_CPU_BACKEND": "python"}
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
        assert metric(text, "minisgl_spec_accepted_tokens_total") > 0
        assert metric(text, "minisgl_spec_mean_accepted_length") > 1


@pytest.mark.card(CARD, "every-kv-page-returns-after-speculative-scenarios", RED, GREEN)
def test_a_verify_step_keeps_no_decode_workspace():
    """The SDPA decode workspace appends a token a step per slot; a verify step's rows past a
    request's accepted length are rewritten next step, so a batch with a slot twice keeps none."""
    import torch

    from minisgl.attention.decode_workspace import DecodeWorkspace

    ws = DecodeWorkspace(2, 2, 16, torch.float32, torch.device("cpu"))
    assert ws.mode(np.array([0, 1]), np.array([5, 7])) == "rebuild"
    assert ws.mode(np.array([0, 1]), np.array([6, 8])) == "append"
    assert ws.mode(np.array([0, 0, 1]), np.array([7, 8, 9])) is None
    assert ws.mode(np.array([0, 0, 1]), np.array([8, 9, 10])) is None
    assert ws.mode(np.array([0, 1]), np.array([8, 10])) == "rebuild"


@pytest.mark.card(CARD, "benchmark-prints-both-arms-and-the-ratio", GREEN)
def test_the_offline_harness_runs_a_profile_with_speculation(tiny, tmp_path):
    """`harness offline --speculative-algorithm ngram` serves any profile with drafts and puts
    the drafts' counts, acceptance and mean accepted length in the record and its gate
    metrics (issue 62 item 6: batched profiles measured with and without)."""
    from minisgl.benchmark import harness

    def run(argv: list[str]) -> int:
        try:
            return harness.main(argv)
        except SystemExit as exc:  # argparse: an unknown flag
            raise AssertionError(f"the harness refused its flags (exit {exc.code})") from None

    out = tmp_path / "spec.json"
    rc = run(["offline", "--model-path", str(tiny), "--out", str(out), "--no-progress",
                       "--profile", "many-short", "--set", "num_requests=6",
                       "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "3",
                       "--set", "llm.num_pages=2048"])  # fmt: skip
    assert rc == 0
    record = json.loads(out.read_text())
    spec = record["speculative"]
    assert spec["algorithm"] == "ngram" and spec["num_draft_tokens"] == 3, spec
    assert spec["verify_steps"] >= 0 and 0.0 <= spec["acceptance_rate"] <= 1.0, spec
    assert record["gate_metrics"]["speculative.acceptance_rate"] == spec["acceptance_rate"]
    off = tmp_path / "off.json"
    rc = run(["offline", "--model-path", str(tiny), "--out", str(off), "--no-progress",
                       "--profile", "many-short", "--set", "num_requests=6",
                       "--set", "llm.num_pages=2048"])  # fmt: skip
    assert rc == 0 and json.loads(off.read_text())["speculative"] is None
