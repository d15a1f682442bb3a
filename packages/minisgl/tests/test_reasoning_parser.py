"""Issue 63 item 3, offline: the reasoning parsers (`qwen3`, `deepseek-r1`) split an output into
its `<think>` reasoning and its content, whole and streamed in any split (a tag cut across
deltas never leaks), and the grammars of `response_format` / tools gain a `<think>` prefix that
llguidance accepts before the constrained answer."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.reasoning import (
    REASONING_FORMATS,
    get_reasoning_format,
    tag_tokens,
    with_reasoning,
)
from minisgl.structured import ResponseFormat

CARD = "P3-004"
RED = "reasoning-tests-fail-before-the-parsers-exist"
GREEN = "reasoning-tests-pass"
SPLIT = "a-parser-per-reasoning-format-splits-whole-and-streamed-output"
GRAMMAR = "grammars-allow-a-think-prefix-before-the-answer"
BAD = "bad-reasoning-input-is-a-clear-error"


def reference(text: str, inside: bool) -> tuple[str | None, str]:
    """The split, written plainly: (reasoning or None when there is none, content)."""
    if not inside:
        s = text.lstrip()
        if not s.startswith("<think>"):
            return None, text
        rest = s[len("<think>") :]
    else:
        rest = text
        if rest.lstrip().startswith("<think>"):
            rest = rest.lstrip()[len("<think>") :]
    i = rest.find("</think>")
    if i < 0:
        return rest.strip(), ""
    return rest[:i].strip(), rest[i + len("</think>") :].lstrip()


def streamed(name: str, parts: list[str], inside: bool) -> tuple[str | None, str, list]:
    """The stream's joined reasoning and content, and every delta it gave."""
    stream = get_reasoning_format(name).stream(inside)
    deltas = [stream.feed(p) for p in parts] + [stream.finish()]
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    return (reasoning if stream.entered else None), content, deltas


CASES = [
    # (text, inside, reasoning, content)
    (
        "<think>\nLet me see.\n</think>\n\nThe answer is 4.",
        False,
        "Let me see.",
        "The answer is 4.",
    ),
    ("The answer is 4.", False, None, "The answer is 4."),
    ("  <think>a</think>b", False, "a", "b"),
    ("x <think>a</think>b", False, None, "x <think>a</think>b"),  # not at the start: content
    ("<think>unfinished", False, "unfinished", ""),
    ("Let me see.\n</think>\n\n4", True, "Let me see.", "4"),
    ("<think>\nr</think>c", True, "r", "c"),  # a model that writes the opening tag itself
    ("only reasoning", True, "only reasoning", ""),
    ("</think>", True, "", ""),
    ("a</think>b</think>c", True, "a", "b</think>c"),  # the first close ends it
    ("", False, None, ""),
    ("", True, "", ""),
]


@pytest.mark.card(CARD, SPLIT, RED, GREEN)
@pytest.mark.parametrize("name", ["qwen3", "deepseek-r1"])
@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), CASES)
def test_whole_output_splits(name, text, inside, reasoning, content):
    fmt = get_reasoning_format(name)
    assert fmt.split(text, inside) == (reasoning, content)
    assert streamed(name, [text], inside)[:2] == (reasoning, content)


@pytest.mark.card(CARD, SPLIT, RED, GREEN)
@pytest.mark.parametrize("name", ["qwen3", "deepseek-r1"])
@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), CASES)
def test_every_two_way_and_per_character_split_gives_the_same(name, text, inside, reasoning,
                                                               content):  # fmt: skip
    for i in range(len(text) + 1):
        assert streamed(name, [text[:i], text[i:]], inside)[:2] == (reasoning, content), i
    assert streamed(name, list(text), inside)[:2] == (reasoning, content)


PIECES = ["<think>", "</think>", "<", "</", "<th", "</thi", "nk>", "think", ">", " ", "\n", "a",
          "b c", "{\"x\": 1}", "</think", "<think"]  # fmt: skip


@pytest.mark.card(CARD, SPLIT, RED, GREEN)
@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=14),
    cuts=st.lists(st.integers(0, 200), max_size=6),
    inside=st.booleans(),
    name=st.sampled_from(sorted(REASONING_FORMATS)),
)
def test_any_split_of_any_text_matches_the_reference(pieces, cuts, inside, name):
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    parts = [text[a:b] for a, b in itertools.pairwise(bounds)]
    reasoning, content, deltas = streamed(name, parts, inside)
    assert (reasoning, content) == reference(text, inside)
    assert get_reasoning_format(name).split(text, inside) == reference(text, inside)
    # no delta ever carries half a tag that the whole text does not hold there
    for d in deltas:
        for tag in ("<think>", "</think>"):
            for k in range(1, len(tag)):
                if d.content.endswith(tag[:k]):
                    assert tag[:k] in content


@pytest.mark.card(CARD, SPLIT, RED, GREEN)
def test_a_half_tag_is_held_until_it_resolves():
    stream = get_reasoning_format("qwen3").stream(inside=True)
    assert stream.feed("abc </th") == ("abc", "")  # the space and the half tag wait
    assert stream.feed("ink>\n\nHel") == ("", "Hel")
    assert stream.feed("lo") == ("", "lo")
    assert stream.finish() == ("", "")
    maybe = get_reasoning_format("qwen3").stream(inside=False)
    assert maybe.feed("\n<thi") == ("", "")  # may still open a think block
    assert maybe.feed("s is text") == ("", "\n<this is text")
    assert not maybe.entered


@pytest.mark.card(CARD, SPLIT, RED, GREEN)
def test_where_the_output_starts():
    qwen3, r1 = get_reasoning_format("qwen3"), get_reasoning_format("deepseek-r1")
    opened = "<|im_start|>assistant\n<think>\n"
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    plain = "<|im_start|>assistant\n"
    assert qwen3.opens(opened) and not qwen3.opens(closed) and not qwen3.opens(plain)
    # deepseek-r1's output starts inside unless the prompt closed the block
    assert r1.opens(opened) and r1.opens(plain) and not r1.opens(closed)


@pytest.mark.card(CARD, BAD, RED, GREEN)
def test_an_unknown_parser_is_a_value_error_naming_the_known():
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'qwen9'.*deepseek-r1.*qwen3"):
        get_reasoning_format("qwen9")
    assert set(REASONING_FORMATS) == {"qwen3", "deepseek-r1"}


# ----------------------------------------------------------------------------- grammars
@pytest.fixture(scope="module")
def reasoning_tokenizer(tmp_path_factory):
    from minisgl.testing.tiny_reasoning import write_tiny_reasoning_model
    from minisgl.tokenizer.load import load_tokenizer

    path = write_tiny_reasoning_model(tmp_path_factory.mktemp("think"))
    return load_tokenizer(str(path))


def accepts(tok, fmt: ResponseFormat, text: str) -> bool:
    """Whether `text` (tokenized) is a complete output under `fmt`."""
    import llguidance
    import llguidance.hf

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=392)
    m = llguidance.LLMatcher(lltok, fmt.grammar())
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return m.consume_tokens(ids) and not m.is_error() and m.is_accepting()


@pytest.mark.card(CARD, GRAMMAR, RED, GREEN)
def test_a_tag_written_in_pieces_closes_the_block_too(reasoning_tokenizer):
    import llguidance
    import llguidance.hf

    tok = reasoning_tokenizer
    fmt = with_reasoning(ResponseFormat.parse({"type": "choice", "choice": ["red"]}),
                         get_reasoning_format("qwen3"), True, tag_tokens(tok))  # fmt: skip
    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=392), fmt.grammar())
    pieces = [tok.convert_tokens_to_ids(c) for c in ["a", "<", "/", "t", "h", "i", "n", "k", ">"]]
    red = tok("red", add_special_tokens=False)["input_ids"]
    assert m.consume_tokens(pieces + red) and m.is_accepting(), m.get_error()


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
FORMATS = {
    "json_schema": ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, '{"a":12}',
                    '{"a":"x"}'),
    "json_object": ({"type": "json_object"}, '{"k":[1,2]}', "[1]"),  # compact, as without reasoning
    "regex": ({"type": "regex", "regex": r"[a-c]{2}/\d{3}"}, "ab/123", "ab123"),
    "choice": ({"type": "choice", "choice": ["red", 'say "hi"']}, 'say "hi"', "blue"),
}  # fmt: skip


@pytest.mark.card(CARD, GRAMMAR, RED, GREEN)
@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_constrained_answers_follow_a_think_block(reasoning_tokenizer, kind):
    raw, good, bad = FORMATS[kind]
    fmt = ResponseFormat.parse(raw)
    qwen3 = get_reasoning_format("qwen3")
    tok = reasoning_tokenizer
    tags = tag_tokens(tok)  # the tags are single added tokens, as in Qwen3's tokenizer
    assert tags == {"<think>": 384, "</think>": 385}
    inside = with_reasoning(fmt, qwen3, inside=True, tags=tags)  # the prompt opened <think>
    maybe = with_reasoning(fmt, qwen3, inside=False, tags=tags)
    assert inside.kind == maybe.kind == "grammar"
    assert ResponseFormat.parse(inside.to_json()) == inside  # it travels as any grammar
    assert accepts(tok, inside, 'Let me think {"a": 1}.\n</think>\n\n' + good)
    assert accepts(tok, inside, "</think>" + good)
    assert not accepts(tok, inside, good)  # inside: the block must close first
    assert not accepts(tok, inside, "hmm</think>\n" + bad)
    assert accepts(tok, maybe, good)  # not opened: the block is optional
    assert accepts(tok, maybe, "<think>\nhmm\n</think>\n\n" + good)
    assert not accepts(tok, maybe, "<think>hmm</think>" + bad)
    assert not accepts(tok, maybe, bad)


@pytest.mark.card(CARD, GRAMMAR, RED, GREEN)
def test_tool_grammars_follow_a_think_block(reasoning_tokenizer):
    from minisgl.testing.schemas import TOOLS
    from minisgl.tools import get_format, parse_tool_choice, parse_tools

    tools = parse_tools(TOOLS)
    fmt = get_format("hermes").response_format(tools, parse_tool_choice("required", tools, False))
    tok = reasoning_tokenizer
    r1 = get_reasoning_format("deepseek-r1")
    wrapped = with_reasoning(fmt, r1, inside=True, tags=tag_tokens(tok))
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": -4}}\n</tool_call>'
    assert accepts(tok, wrapped, "I should add.\n</think>\n\n" + call)
    assert not accepts(tok, wrapped, call)  # the block opened in the prompt must close first
    assert not accepts(tok, wrapped, "so</think>\n" + call.replace("-4", '"x"'))
    assert not accepts(tok, wrapped, "so</think>\nplain text")
