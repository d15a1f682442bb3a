"""Incremental detokenization: never broken UTF-8 mid-character, stop strings, parity."""

from __future__ import annotations

import pytest

from minisgl.tokenizer.detokenize import DecodeState, Detokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))


def run(tok, ids, stops=(), finish="length"):
    d = Detokenizer(tok)
    st = DecodeState(stops=tuple(stops))
    pieces = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        ((_, text, hit),) = d.update([(st, [t], finish if last else None)])
        pieces.append(text)
        if st.finished:
            return pieces, st, hit
    return pieces, st, False


def test_multibyte_characters_are_never_split(tok):
    text = "é✓日本 fox 🦊 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces, _st, _ = run(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_is_cut_and_never_streamed(tok):
    text = "The quick brown fox jumps over the lazy dog"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces, st, hit = run(tok, ids, stops=["fox j"])
    assert hit and st.finished == "stop"
    assert "".join(pieces) == "The quick brown "
    assert all("fox" not in p for p in pieces)


def test_held_text_is_released_at_finish(tok):
    text = "abc fo"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces, st, hit = run(tok, ids, stops=["fox"])
    assert not hit and st.finished == "length"
    assert "".join(pieces) == text


def test_tokenizer_worker_warms_its_paths_before_ready_and_keeps_no_state(tok):
    """Issue 39: the first request after start must not pay the chat template's compilation
    and the tokenizer's first calls. `warm_up` runs them (chat render, batched encode of both
    special-token settings, a streamed decode) outside any request, reports its time and
    leaves the worker as it was: the next request tokenizes as a fresh worker would."""
    from minisgl.message.schema import Codec, TokenizeReq, WireParams
    from minisgl.tokenizer.worker import TokenizerWorker

    warm, fresh = TokenizerWorker(tok, Codec(True)), TokenizerWorker(tok, Codec(True))
    assert hasattr(warm, "warm_up"), "TokenizerWorker has no warm_up"
    ms = warm.warm_up()
    assert isinstance(ms, float) and ms > 0
    assert warm.states == {} and warm.pending_lp == {}
    chat = [{"role": "user", "content": "Name three colors."}]
    reqs = [TokenizeReq(7, "chat", chat, WireParams()), TokenizeReq(8, "text", "hi", WireParams())]
    got, want = warm.tokenize(reqs), fresh.tokenize(reqs)
    assert [a.input_ids.tolist() for a in got[0]] == [a.input_ids.tolist() for a in want[0]]
    assert got[1] == want[1] == []


@pytest.mark.parametrize("truncating", [False, True])
def test_tokenizer_worker_ids_equal_the_hf_tokenizer_call(tok, truncating):
    """The worker encodes through the Rust backend directly (`encode_batch_fast`, ~25% faster
    than the HF call on random-token prompts): the ids must be the HF call's, for text (with
    BOS) and chat (without), non-ASCII included, even when the tokenizer.json carries a
    truncation setting (the HF call switches it off; the backend alone would apply it)."""
    import copy

    from minisgl.message.schema import Codec, TokenizeReq, WireParams
    from minisgl.tokenizer.worker import TokenizerWorker

    t = copy.deepcopy(tok)
    if truncating:
        t.backend_tokenizer.enable_truncation(max_length=3)
    texts = ["hello world", "héllo wörld ✓ 日本語", "a " * 200, ""]
    chat = [{"role": "user", "content": "Name three colors: ö ✓"}]
    reqs = [TokenizeReq(i, "text", s, WireParams()) for i, s in enumerate(texts)]
    reqs.append(TokenizeReq(len(texts), "chat", chat, WireParams()))
    worker = TokenizerWorker(t, Codec(True))
    assert (worker.backend is None) is truncating  # a truncating backend: the HF call
    adds, rejects = worker.tokenize(reqs)
    assert rejects == []
    got = {a.uid: a.input_ids.tolist() for a in adds}
    rendered = t.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    want = t(texts, add_special_tokens=True)["input_ids"]
    want.append(t([rendered], add_special_tokens=False)["input_ids"][0])
    assert [got[i] for i in range(len(reqs))] == want
    assert len(got[2]) > 3  # never truncated


def test_a_step_decodes_through_the_rust_backend_in_one_call_per_flag(tok, monkeypatch):
    """The worker's detokenizer calls the `tokenizers` backend's `decode_batch` once per
    skip_special_tokens value of a step, not transformers' per-sequence `decode` (its wrapper,
    argument conversion and special-token map cost more than the decoding under load)."""
    import numpy as np

    rng = np.random.default_rng(0)
    specials = sorted(set(tok.all_special_ids))
    seqs = []
    for k in range(6):
        ids = rng.integers(3, len(tok), size=12).tolist()
        ids[3] = specials[k % len(specials)]
        seqs.append(ids)
    flags = [True, False, True, False, True, True]
    want = [tok.decode(ids, skip_special_tokens=f) for ids, f in zip(seqs, flags, strict=True)]
    assert tok.clean_up_tokenization_spaces is False

    def refused(*a, **k):
        raise AssertionError("decoded through transformers' wrapper")

    monkeypatch.setattr(tok, "decode", refused)
    monkeypatch.setattr(tok, "batch_decode", refused)
    calls: list[int] = []
    backend = tok.backend_tokenizer

    class Counting:
        def decode_batch(self, sequences, skip_special_tokens=True):
            calls.append(len(sequences))
            return backend.decode_batch(sequences, skip_special_tokens=skip_special_tokens)

    d = Detokenizer(tok)
    d.backend = Counting()
    states = [DecodeState(skip_special_tokens=f) for f in flags]
    got = [""] * len(seqs)
    for i in range(12):
        calls.clear()
        reason = "length" if i == 11 else None
        items = [(st, [seqs[k][i]], reason) for k, st in enumerate(states)]
        for k, (_, text, _) in enumerate(d.update(items)):
            got[k] += text
        assert len(calls) == 2, calls  # one call per flag value, both windows of each sequence
    assert got == want


def test_a_backlog_is_tokenized_in_waves_of_one_two_four():
    """The first prompt of a burst goes to the engine after one prompt's encoding; a burst of n
    takes O(log n) calls, also when it trickles in; the wave size starts over after a quiet
    spell; aborted prompts leave it."""
    from minisgl.message.schema import TokenizeReq
    from minisgl.tokenizer.worker import Backlog

    def reqs(uids):
        return [TokenizeReq(u, "text", "x", None) for u in uids]

    now = [0.0]
    box = Backlog(quiet_s=0.02, clock=lambda: now[0])
    box.add(reqs(range(10)))
    box.drop({3})
    waves = []
    while box:
        waves.append([r.uid for r in box.take()])
    assert waves == [[0], [1, 2], [4, 5, 6, 7], [8, 9]]
    now[0] += 0.001  # the burst goes on: emptied, but no fresh start
    box.add(reqs(range(20, 40)))
    assert len(box.take()) == 16
    now[0] += 0.05  # quiet: the next burst starts with one prompt
    box.take()
    box.add(reqs([50, 51]))
    assert [r.uid for r in box.take()] == [50]
