"""Issue 63 item 4: `response_format` `{"type": "regex", "regex": P}` and `{"type": "choice",
"choice": [...]}` offline (tiny random llama): the output fullmatches the regex / is one of
the choices, greedy and sampled; a bad regex or choice list is a ValueError naming the field."""

from __future__ import annotations

import re

import pytest

from minisgl.core import SamplingParams
from minisgl.structured import ResponseFormat

CARD = "P3-003"
RED = "server-convention-tests-fail-before-the-flags-and-fields-exist"
GREEN = "server-convention-tests-pass"
ITEM = "regex-and-choice-outputs-match"
BAD = "bad-input-to-every-new-flag-and-field-is-a-clear-error"

REGEX = r"[a-c]{2}-\d{3}"
CHOICES = ["red", "green", "light blue", 'say "hi"/bye']


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from minisgl import LLM

    return LLM(tiny_model_dir("llama"), num_pages=1024, max_seq_len_override=256)


@pytest.mark.card(CARD, ITEM, RED, GREEN)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_output_fullmatches(llm, temperature):
    fmt = {"type": "regex", "regex": REGEX}
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=32, response_format=fmt)
              for s in range(4)]  # fmt: skip
    outs = llm.generate(["The code is", "Hello", "x", "1 2 3"], params)
    for out in outs:
        assert re.fullmatch(REGEX, out["text"]), out["text"]


@pytest.mark.card(CARD, ITEM, RED, GREEN)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_choice_output_is_one_of_the_choices(llm, temperature):
    fmt = {"type": "choice", "choice": CHOICES}
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=32, response_format=fmt)
              for s in range(6)]  # fmt: skip
    outs = llm.generate(["Pick a colour:", "a", "b", "c", "d", "e"], params)
    texts = [o["text"] for o in outs]
    assert all(t in CHOICES for t in texts), texts
    if temperature > 0:
        assert len(set(texts)) > 1, texts  # sampling reaches more than one choice


@pytest.mark.card(CARD, ITEM, RED, GREEN)
def test_regex_and_choice_round_trip_the_wire():
    for raw in ({"type": "regex", "regex": REGEX}, {"type": "choice", "choice": CHOICES}):
        fmt = ResponseFormat.parse(raw)
        assert fmt is not None and fmt.kind == raw["type"]
        assert ResponseFormat.parse(fmt.to_json()) == fmt


@pytest.mark.card(CARD, BAD, RED, GREEN)
@pytest.mark.parametrize(
    "raw, match",
    [
        ({"type": "regex", "regex": "(ab"}, r"response_format\.regex: .*unclosed group"),
        ({"type": "regex", "regex": "a(?=b)"}, r"response_format\.regex: .*look-around"),
        ({"type": "regex", "regex": ""}, r"response_format\.regex must be a non-empty string"),
        ({"type": "regex"}, r"response_format\.regex must be a non-empty string"),
        ({"type": "choice", "choice": []}, r"response_format\.choice must be a non-empty list"),
        ({"type": "choice", "choice": "red"}, r"response_format\.choice must be a non-empty list"),
        ({"type": "choice", "choice": ["a", 1]}, r"response_format\.choice\[1\] must be a non-"),
        ({"type": "choice", "choice": ["a", ""]}, r"response_format\.choice\[1\] must be a non-"),
    ],
)
def test_bad_regex_or_choice_is_a_value_error(raw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(response_format=raw)
