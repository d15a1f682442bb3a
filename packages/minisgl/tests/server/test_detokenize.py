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
