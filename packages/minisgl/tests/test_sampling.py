"""The batched sampler against HF's logits processors on the same logits, seeded draws that do
not depend on the batch, bad rows that fail alone, and parallel sampling through the prefix
cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from minisgl import SamplingParams
from minisgl.sampler import (
    apply_penalties,
    filter_min_p,
    filter_top_k_top_p,
    request_key,
    sample,
    uniform_noise,
)

VOCAB = 64


@dataclass
class Row:
    params: SamplingParams
    generator: int = 7
    input_ids: np.ndarray = field(default_factory=lambda: np.array([1, 2, 3], dtype=np.int32))
    output_ids: list[int] = field(default_factory=list)


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def test_repetition_penalty_matches_hf():
    x = logits(3)
    prompts = [[1, 2, 3], [5, 5], [9]]
    outputs = [[4, 4, 1], [], [9, 10]]
    pens = [1.3, 0.7, 1.0]
    got = apply_penalties(x, outputs, prompts, torch.zeros(3), torch.zeros(3), torch.tensor(pens))
    for i in range(3):
        ids = torch.tensor([prompts[i] + outputs[i]])
        want = RepetitionPenaltyLogitsProcessor(pens[i])(ids, x[i : i + 1].clone())
        torch.testing.assert_close(got[i : i + 1], want)


def test_presence_and_frequency_follow_openai_formula():
    x = logits(2)
    outputs = [[4, 4, 4, 7], [1]]
    pres, freq = torch.tensor([0.5, -1.0]), torch.tensor([0.3, 2.0])
    got = apply_penalties(x, outputs, [[4], [2]], pres, freq, torch.ones(2))
    want = x.clone()
    for i, out in enumerate(
        outputs
    ):  # mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence
        for t in set(out):
            c = out.count(t)
            want[i, t] -= c * freq[i] + pres[i]
    torch.testing.assert_close(got, want)


def hf_warp(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    ids = torch.zeros(1, 1, dtype=torch.long)
    x = TemperatureLogitsWarper(temperature)(ids, x.clone())
    if top_k > 0:
        x = TopKLogitsWarper(top_k)(ids, x)
    if top_p < 1:
        x = TopPLogitsWarper(top_p)(ids, x)
    if min_p > 0:
        x = MinPLogitsWarper(min_p)(ids, x)
    return x


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 5, 1.0, 0.0), (0.7, 0, 0.8, 0.0), (1.3, 10, 0.9, 0.05), (1.0, 0, 1.0, 0.2)],
)
def test_top_k_top_p_min_p_keep_the_tokens_hf_keeps(temperature, top_k, top_p, min_p):
    x = logits(4, seed=top_k)
    y = x / temperature
    k = torch.full((4,), top_k if top_k > 0 else VOCAB)
    full = filter_top_k_top_p(y, k, torch.full((4,), top_p))
    if top_k > 0:  # the bounded path (topk instead of a full sort) keeps the same tokens
        bounded = filter_top_k_top_p(y, k, torch.full((4,), top_p), k_bound=top_k + 3)
        torch.testing.assert_close(bounded, full)
    y = full
    if min_p > 0:
        y = filter_min_p(y, torch.full((4,), min_p))
    for i in range(4):
        want = hf_warp(x[i : i + 1], temperature, top_k, top_p, min_p)
        assert torch.equal(torch.isfinite(y[i]), torch.isfinite(want[0]))
        keep = torch.isfinite(want[0])
        torch.testing.assert_close(y[i][keep], want[0][keep])


def test_logit_bias_and_min_tokens_match_hf_in_greedy_picks():
    x = logits(2, seed=3)
    best = int(x[0].argmax())
    bias = {best: -100.0, 11: 5.0}
    row = Row(SamplingParams(logit_bias=bias, max_tokens=4))
    hf = SequenceBiasLogitsProcessor({(t,): v for t, v in bias.items()})
    want = hf(torch.tensor([[1, 2, 3]]), x[:1].clone())
    assert sample(x[:1], [row]).tokens == [int(want.argmax())]
    # min_tokens: EOS (and stop_token_ids) are banned until min_tokens were generated
    eos = int(x[1].argmax())
    early = Row(SamplingParams(min_tokens=2, max_tokens=4), output_ids=[5])
    hf_min = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=3, min_new_tokens=2,
                                               eos_token_id=eos)  # fmt: skip
    want = hf_min(torch.tensor([[1, 2, 3, 5]]), x[1:2].clone())
    assert sample(x[1:2], [early], frozenset({eos})).tokens == [int(want.argmax())] != [eos]
    late = Row(SamplingParams(min_tokens=2, max_tokens=4), output_ids=[5, 6])
    assert sample(x[1:2], [late], frozenset({eos})).tokens == [eos]


def test_logprobs_are_the_raw_log_softmax():
    x = logits(3, seed=5)
    rows = [Row(SamplingParams(logprobs=3)), Row(SamplingParams()), Row(SamplingParams(logprobs=0))]
    res = sample(x, rows)
    lp = torch.log_softmax(x, dim=-1)
    top = lp[0].topk(3)
    got = res.logprobs[0]
    assert got.token_id == res.tokens[0] == int(x[0].argmax())
    assert got.logprob == pytest.approx(float(lp[0, got.token_id]), abs=1e-6)
    assert [t for t, _ in got.top] == top.indices.tolist()
    assert [v for _, v in got.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert res.logprobs[1] is None
    assert res.logprobs[2].top == () and res.logprobs[2].logprob == pytest.approx(
        float(lp[2, res.tokens[2]]), abs=1e-6
    )


def test_seeded_draws_do_not_depend_on_the_batch():
    x = logits(6, seed=9)
    p = SamplingParams(temperature=1.0, seed=42)
    for step in range(20):
        alone = sample(x[2:3], [Row(p, request_key(42), output_ids=[0] * step)]).tokens[0]
        others = [Row(SamplingParams(temperature=0.9, top_p=0.9), request_key(None)) for _ in x]
        others[2] = Row(p, request_key(42), output_ids=[0] * step)
        others[4] = Row(SamplingParams())  # a greedy row in the same batch
        assert sample(x, others).tokens[2] == alone


def test_noise_is_uniform_and_sampling_follows_softmax():
    u = uniform_noise(
        torch.arange(4000, dtype=torch.int64), torch.zeros(4000, dtype=torch.int64), 8
    )
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert float(u.mean()) == pytest.approx(0.5, abs=0.01)
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 4000
    rows = [Row(SamplingParams(temperature=1.0), generator=k) for k in range(n)]
    toks = sample(x.expand(n, 4).contiguous(), rows).tokens
    freq = np.bincount(toks, minlength=4) / n
    np.testing.assert_allclose(freq, torch.softmax(x, -1)[0].numpy(), atol=0.03)


# key 194 at step 0 draws 2**24 - 1 of its 24 bits at token 35911: (k + 0.5) / 2**24 rounds to
# 1.0 in float32, a Gumbel of +inf, and -inf + inf is a NaN that argmax takes (the CI run of
# 3bf486f sampled a token its grammar forbade, then failed the request with a 500)
TOP_KEY, TOP_TOKEN = 194, 35911


def test_noise_stays_below_one_where_its_24_bits_are_all_ones():
    u = uniform_noise(torch.tensor([TOP_KEY]), torch.tensor([0]), TOP_TOKEN + 1)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0


def test_a_forbidden_token_is_never_drawn_even_at_the_top_noise():
    x = torch.zeros(1, TOP_TOKEN + 1)
    x[0, TOP_TOKEN] = float("-inf")  # what a grammar's mask or a -inf bias leaves
    res = sample(x, [Row(SamplingParams(temperature=1.0), generator=TOP_KEY)])
    assert res.errors == [None] and res.tokens[0] != TOP_TOKEN


def test_bad_rows_fail_alone_and_tiny_temperatures_are_greedy():
    x = logits(4, seed=11)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    rows = [Row(SamplingParams(temperature=1e-40)), Row(SamplingParams(temperature=0.8)),
            Row(SamplingParams()), Row(SamplingParams(temperature=0.8, seed=1))]  # fmt: skip
    res = sample(x, rows)
    assert res.errors[0] is None and res.tokens[0] == int(x[0].argmax())
    assert res.errors[1] and res.errors[2]
    assert res.errors[3] is None and 0 <= res.tokens[3] < VOCAB


def test_sampling_params_validation():
    for bad in (
        dict(temperature=float("nan")),
        dict(min_p=2.0),
        dict(presence_penalty=3.0),
        dict(repetition_penalty=0.0),
        dict(min_tokens=20, max_tokens=4),
        dict(logprobs=21),
        dict(logit_bias={1: 500}),
        dict(n=0),
    ):
        with pytest.raises((ValueError, TypeError)):
            SamplingParams(**bad)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from minisgl import LLM

    return LLM(tiny_model_dir("llama"), num_pages=4096, max_seq_len_override=256)


def test_n_samples_share_the_prompt_kv(llm):
    prompt = list(range(3, 67))  # 64 tokens
    st = llm.scheduler.stats
    before_p, before_c = st.prompt_tokens, st.cached_prompt_tokens
    out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5, max_tokens=6, n=4))[0]
    assert len(out["outputs"]) == 4 and out["token_ids"] == out["outputs"][0]["token_ids"]
    assert len({tuple(o["token_ids"]) for o in out["outputs"]}) > 1  # seeds 5, 6, 7, 8
    # the leader computes the prompt; each of the 3 others reuses all but its last token
    assert st.prompt_tokens - before_p == 4 * 64
    assert st.cached_prompt_tokens - before_c == 3 * 63
    again = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5, max_tokens=6, n=4))[0]
    assert [o["token_ids"] for o in again["outputs"]] == [o["token_ids"] for o in out["outputs"]]


def test_generate_returns_logprobs_and_penalized_text(llm):
    p = SamplingParams(max_tokens=8, logprobs=2, repetition_penalty=1.5, ignore_eos=True)
    out = llm.generate(["hello hello hello"], p)[0]
    assert len(out["logprobs"]) == len(out["token_ids"]) == 8
    assert [lp.token_id for lp in out["logprobs"]] == out["token_ids"]
    assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in out["logprobs"])
    assert out["error"] is None and out["finish_reason"] == "length"


@pytest.mark.rust_ext
def test_both_scheduler_backends_sample_the_same_tokens(tiny_model_dir, monkeypatch):
    from minisgl import LLM

    prompts = ["the fox jumps", [5, 6, 7, 8, 9, 10], "over the dog"]
    params = [
        SamplingParams(temperature=0.9, seed=1, max_tokens=10, n=3, presence_penalty=0.5,
                       repetition_penalty=1.2, min_p=0.05, logit_bias={7: 2.0}, min_tokens=3),
        SamplingParams(temperature=1.2, top_k=8, top_p=0.9, seed=2, max_tokens=12,
                       frequency_penalty=0.7, logprobs=1),
        SamplingParams(max_tokens=8, repetition_penalty=1.4),
    ]  # fmt: skip
    outs = {}
    for backend in ("python", "rust_hotpath"):
        monkeypatch.setenv("MINISGL_CPU_BACKEND", backend)
        llm = LLM(tiny_model_dir("llama"), num_pages=4096, max_seq_len_override=256)
        assert llm.scheduler.backend == backend
        res = llm.generate(prompts, params)
        outs[backend] = [[o["token_ids"] for o in r["outputs"]] for r in res]
        assert llm.scheduler.stats.cached_prompt_tokens >= 2 * (len(res[0]["outputs"]) - 1)
    assert outs["python"] == outs["rust_hotpath"]


def test_bad_rows_are_a_nan_or_posinf_of_the_raw_logits_or_nothing_above_neginf():
    """A bad row has a NaN or +inf among its raw logits, or nothing above -inf once biases and
    penalties apply; +inf made by a penalty from finite logits is a good row's argmax (a
    repetition penalty of 5e-324 divides a positive logit into +inf)."""
    from minisgl.sampler import greedy_device, sample_on_device

    x = logits(9, seed=3)
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    x[3] = float("-inf")  # nothing above -inf
    x[4, :] = float("-inf")
    x[4, 11] = float("nan")
    x[5, 13] = float("-inf")  # one -inf: a good row
    x[6] = float("-inf")
    x[6, 2] = 1.0  # -inf but one: a good row whose argmax is 2
    x[7, 5] = float("inf")
    x[7, 6] = float("nan")
    x[8, 1] = abs(float(x[8, 1])) + 0.5  # prompt token 1 is positive: 1 / 5e-324 is +inf
    want_bad = [False, True, True, True, True, False, False, True, False]
    tokens, bad = greedy_device(x)
    assert bad.tolist() == want_bad
    good = [i for i, b in enumerate(want_bad) if not b]
    assert tokens[good].tolist() == x[good].argmax(-1).tolist() and int(tokens[6]) == 2
    rows = [Row(SamplingParams()) for _ in range(9)]
    top2 = x[0].topk(2)
    assert float(top2.values[0] - top2.values[1]) < 100
    rows[0] = Row(SamplingParams(logit_bias={int(top2.indices[0]): -100}))
    rows[8] = Row(SamplingParams(repetition_penalty=5e-324))
    out = sample_on_device(x, rows)
    assert out.bad.tolist() == want_bad
    assert int(out.tokens[0]) == int(top2.indices[1])  # the bias moved the argmax
    assert int(out.tokens[8]) == 1  # the penalised +inf
    plain = sample_on_device(x, [Row(SamplingParams()) for _ in range(9)])
    assert plain.bad.tolist() == want_bad and plain.tokens[good].tolist() == tokens[good].tolist()


def test_bf16_logits_sample_as_their_fp32_widening():
    """Logits stay in the model's dtype until arithmetic needs fp32: every kind of row samples
    the same tokens, bad rows and logprobs from bf16 logits as from the same values in fp32."""
    from minisgl.sampler import sample_on_device

    x = logits(6, seed=5).to(torch.bfloat16)
    x[5, 3] = float("nan")
    params = [
        SamplingParams(),
        SamplingParams(logit_bias={int(x[1].float().argmax()): -100}),
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=11),
        SamplingParams(logprobs=3, min_tokens=2, stop_token_ids=[4]),
        SamplingParams(),
    ]
    rows = [Row(p, output_ids=[4, 4]) if i == 2 else Row(p) for i, p in enumerate(params)]
    got, want = sample_on_device(x, rows), sample_on_device(x.float(), rows)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.bad.tolist() == want.bad.tolist() == [False] * 5 + [True]
    torch.testing.assert_close(got.lp_vals, want.lp_vals)
    assert got.tokens.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["native", "sdpa"])  # the C kernel, or torch.max without it
def test_row_max_is_torch_max_with_nans_ties_and_signed_zeros(dtype, kernel):
    """The sampler's argmax (`row_max`, a C kernel on CPU) gives torch.max's values and indices:
    the first of tied maxima, a row's first NaN, -0 equal to +0, all -inf rows at index 0."""
    from minisgl.sampler import row_max
    from minisgl.testing.scenarios import cpu_attention

    g = torch.Generator().manual_seed(0)
    wide = torch.randn(12, 300, generator=g).to(dtype)
    x = wide[:, :257]  # rows 300 elements apart: a stride the kernel takes as it is
    x[1, 200] = x[1, 3] = 9.0  # a tie: the first wins
    x[2, 150] = x[2, 40] = float("nan")  # NaN propagates: its first index
    x[2, 10] = float("inf")
    x[3] = float("-inf")
    x[4] = 0.0
    x[4, 5] = -0.0
    x[4, 0] = -1.0
    x[5, 256] = float("inf")
    x[6] = -3.0  # a constant row
    x[7, 64] = x[7, 63] = 5.0  # a tie across the kernel's 64-element blocks
    with cpu_attention(kernel):
        got, got_idx = row_max(x)
        again = row_max(x.t().contiguous().t())  # columns contiguous: torch.max itself
    top, idx = x.max(dim=-1)
    assert got.dtype == dtype and got_idx.dtype == torch.int64
    assert torch.equal(got_idx, idx) and got_idx[:8].tolist() == [
        int(idx[0]),
        3,
        40,
        0,
        1,
        256,
        0,
        63,
    ]
    assert torch.equal(got.nan_to_num(), top.nan_to_num()) and bool(got[2].isnan())
    assert torch.equal(again[1], idx)
