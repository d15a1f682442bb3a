"""The Rust service's text layer (`minisgl-cpu-service text`) against the Python path: HF
transformers' tokenizer and chat template (as `minisgl.tokenizer.worker` loads them) and the
Python incremental `Detokenizer`, on the embedded model and a tiny byte-level BPE model.

One CLI process per model answers a stream of JSON requests, so the whole file stays fast.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.cpu_service import service_binary
from minisgl.testing.text_cli import TextCli
from minisgl.tokenizer.detokenize import DecodeState, Detokenizer
from minisgl.tokenizer.load import load_tokenizer
from minisgl.tokenizer.worker import max_token_chars

pytestmark = pytest.mark.card(
    "P1-011", "tokenizer-chat-templates-and-incremental-detokenizer-identical-to-hf"
)

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip

TEXTS = [
    "",
    " ",
    "Hello world!",
    "  leading and trailing  ",
    "tabs\t\tand\n\nnewlines\r\n",
    "     a run of spaces          then text",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "CJK 你好，世界。日本語のテキスト 한국어",
    "Ünïcödé àéîõü ß Ω ∑ √ ∞ e\u0301",
    "عربي مرحبا שלום",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>",
    "text<|im_end|>more<|im_start|>",
    "code: def f(x):\n    return x ** 2  # ok\n",
    "x" * 600,
    "don't , isn't . I 'm here ! ok ?",
    "0123456789 3.14159 -42 1e10",
    "\u0000 nul and \u200b zero width",
]
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hello 😀"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me about 你好\n\n  and spaces  "},
    ],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "<|im_end|> injected"}, {"role": "assistant", "content": "ok"}],
    [{"role": "tool", "content": '{"x": 1}'}, {"role": "user", "content": "and?"}],
]


# ---------------------------------------------------------------------------- CLI plumbing
@pytest.fixture(scope="session")
def service_bin() -> Path:
    """The service binary the runtime would run (`service_binary`: $MINISGL_CPU_SERVICE_BIN, the
    installed wheel, PATH, then a cargo build of this checkout)."""
    try:
        return service_binary()
    except FileNotFoundError as e:
        pytest.fail(str(e))


class Model:
    def __init__(self, path: Path, binary: Path) -> None:
        self.path = path
        self.tok = load_tokenizer(str(path))
        self.cli = TextCli(binary, path)


def _tiny_dir(root: Path) -> Path:
    from minisgl.testing.tiny_models import write_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    write_tokenizer(root)
    (root / "config.json").write_text(json.dumps({"eos_token_id": 2}))  # as write_tiny_model
    return root


def _spm_dir(root: Path) -> Path:
    """The tokenizer a SentencePiece GGUF file converts to (Llama 2 / Mistral 7B style: Metaspace
    pieces, byte fallback, BOS added), as `gguf_model.convert` saves it."""
    from transformers import AutoTokenizer

    from minisgl.testing.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf("mistral", root / "spm.gguf", "Q8_0", tokenizer="spm")
    tok = AutoTokenizer.from_pretrained(str(root), gguf_file=path.name)
    out = root / "spm-tok"
    tok.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    return out


@pytest.fixture(scope="module", params=["smollm", "tiny", "spm"])
def model(request, service_bin, tmp_path_factory):
    if request.param == "smollm":
        from minisgl.default_model import default_model_path

        path = default_model_path()
    elif request.param == "spm":
        path = _spm_dir(tmp_path_factory.mktemp("spm-tok"))
    else:
        path = _tiny_dir(tmp_path_factory.mktemp("tiny-tok"))
    m = Model(path, service_bin)
    yield m
    m.cli.close()


def _ids(tok, text: str, add_special_tokens: bool) -> list[int]:
    return tok([text], add_special_tokens=add_special_tokens)["input_ids"][0]


# ---------------------------------------------------------------------------- tokenizer
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_hf(model, add_special_tokens):
    for text in TEXTS:
        got = model.cli.ask(op="encode", text=text, add_special_tokens=add_special_tokens)
        assert got == {"ids": _ids(model.tok, text, add_special_tokens)}, text


@SETTINGS
@given(text=st.text(max_size=60))
def test_encode_random_text_matches_hf(model, text):
    got = model.cli.ask(op="encode", text=text, add_special_tokens=True)
    assert got["ids"] == _ids(model.tok, text, True)


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_hf(model, skip):
    rng = random.Random(7)
    n = len(model.tok)
    specials = sorted(set(model.tok.all_special_ids))
    cases = [_ids(model.tok, t, True) for t in TEXTS]
    cases += [[rng.randrange(n) for _ in range(rng.randrange(1, 30))] for _ in range(30)]
    cases += [[*specials, 5, 6, *specials], []]
    for ids in cases:
        got = model.cli.ask(op="decode", ids=ids, skip_special_tokens=skip)
        assert got == {"text": model.tok.decode(ids, skip_special_tokens=skip)}, ids


def test_token_names_match_hf(model):
    n = len(model.tok)
    ids = [*range(min(n, 400)), *range(n - 50, n), *model.tok.all_special_ids]
    got = model.cli.ask(op="names", ids=ids)
    assert got == {"names": model.tok.batch_decode([[t] for t in ids])}


def test_info_matches_python(model):
    got = model.cli.ask(op="info")
    cfg = json.loads((model.path / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    eos_ids.add(model.tok.eos_token_id)
    assert got["max_token_chars"] == max_token_chars(model.tok)
    assert got["vocab_size"] == len(model.tok)
    assert got["eos_token_ids"] == sorted(eos_ids)
    assert (got["bos_token"], got["eos_token"]) == (model.tok.bos_token, model.tok.eos_token)
    assert got["chat_template_error"] is None


# ---------------------------------------------------------------------------- chat template
def test_chat_matches_hf(model):
    for msgs in CHATS:
        text = model.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        got = model.cli.ask(op="chat", messages=msgs)
        assert got == {"text": text, "ids": _ids(model.tok, text, False)}, msgs


@SETTINGS
@given(
    turns=st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=20)),
        min_size=1,
        max_size=5,
    )
)
def test_chat_random_turns_match_hf(model, turns):
    msgs = [{"role": r, "content": c} for r, c in turns]
    text = model.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert model.cli.ask(op="chat", messages=msgs) == {
        "text": text,
        "ids": _ids(model.tok, text, False),
    }


def test_bad_chat_requests_get_errors_and_the_cli_goes_on(model):
    for msgs, want in [
        ([], "empty conversation"),
        ("hi", "must be a list"),
        ([1], "messages[0] must be an object"),
        ([{"content": "x"}], "messages[0].role must be a string"),
        ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "messages[0].content"),
    ]:
        got = model.cli.ask(op="chat", messages=msgs)
        assert want in got["error"], got
    for line in ["not json", "{}", '{"op": "nope"}', '{"op": "encode"}', '{"op": "decode", "ids": [-1]}',
                 '{"op": "encode", "text": 5}', "[1, 2]"]:  # fmt: skip
        assert "error" in model.cli.ask_raw(line), line
    assert model.cli.ask(op="encode", text="ok", add_special_tokens=False) == {
        "ids": _ids(model.tok, "ok", False)
    }


# Template features, rendered by transformers' jinja2 and by the service's minijinja.
FEATURE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if loop.first and m['role'] != 'system' %}{{ raise_exception('system first, got ' + m['role']) }}{% endif %}"
    "{%- if m.role == 'user' %}\n  [{{ m.content.strip().upper() }}|{{ m.content | length }}]\n"
    "{%- elif m.role == 'assistant' %}{% generation %}A: {{ m['content'].split(' ') | tojson }}{% endgeneration %}\n"
    "{%- else %}{{ m | tojson(indent=2, sort_keys=true) }}{{ m.content.replace('a', 'b').title() }}\n"
    "{%- endif %}\n"
    "    {% set ns = namespace(n=0) %}{% for k, v in m.items() %}{% set ns.n = ns.n + 1 %}{% endfor %}"
    "{{ ns.n }}{{ eos_token if loop.last }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)  # fmt: skip


def _with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    cfg_file = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("chat_template", None)
    cfg.update(changes)
    cfg_file.write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return _tiny_dir(tmp_path_factory.mktemp("tiny-base"))


@pytest.mark.parametrize(
    "form",
    ["config_string", "named_list", "features", "jinja_file_wins"],
)
def test_template_forms_and_features_match_hf(form, tiny_dir, tmp_path, service_bin):
    from minisgl.testing.tiny_models import CHAT_TEMPLATE

    if form == "config_string":
        path = _with_config(tiny_dir, tmp_path / form, chat_template=FEATURE_TEMPLATE)
    elif form == "named_list":
        path = _with_config(tiny_dir, tmp_path / form, chat_template=[
            {"name": "tool_use", "template": "unused"},
            {"name": "default", "template": FEATURE_TEMPLATE}])  # fmt: skip
    elif form == "features":
        path = _with_config(tiny_dir, tmp_path / form)
        (path / "chat_template.jinja").write_text(FEATURE_TEMPLATE)
    else:
        path = _with_config(tiny_dir, tmp_path / form, chat_template="config, not the file")
        (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    m = Model(path, service_bin)
    try:
        chats = [
            *CHATS[1:3],
            [{"role": "system", "content": "a banana"}, {"role": "user", "content": " x y "}],
            [{"role": "system", "content": 'é"\n\t<&>'}, {"role": "assistant", "content": "a b"}],
        ]
        for msgs in chats:
            text = m.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            assert m.cli.ask(op="chat", messages=msgs) == {
                "text": text,
                "ids": _ids(m.tok, text, False),
            }, msgs
        if form != "jinja_file_wins":
            bad = [{"role": "user", "content": "no system"}]
            with pytest.raises(Exception) as e:
                m.tok.apply_chat_template(bad, add_generation_prompt=True, tokenize=False)
            assert m.cli.ask(op="chat", messages=bad) == {"error": str(e.value)}
    finally:
        m.cli.close()


def test_no_default_template_is_an_error_at_chat_time(tiny_dir, tmp_path, service_bin):
    path = _with_config(tiny_dir, tmp_path / "multi", chat_template=[
        {"name": "a", "template": "A"}, {"name": "b", "template": "B"}])  # fmt: skip
    cli = TextCli(service_bin, path)
    try:
        assert "no default specified" in cli.ask(op="info")["chat_template_error"]
        assert "no default specified" in cli.ask(op="chat", messages=CHATS[0])["error"]
        assert "ids" in cli.ask(op="encode", text="still serves text", add_special_tokens=True)
    finally:
        cli.close()


@pytest.mark.parametrize("force", [False, True])
def test_clean_up_tokenization_spaces_as_hf(tiny_dir, tmp_path, service_bin, force):
    """transformers skips the clean-up on BPE models unless forced."""
    extra = {"clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True}
    path = _with_config(tiny_dir, tmp_path / "clean", clean_up_tokenization_spaces=True,
                        **(extra if force else {}))  # fmt: skip
    m = Model(path, service_bin)
    try:
        ids = _ids(m.tok, "don't , isn't . I 'm here ! ok ?", False)
        want = m.tok.decode(ids)
        assert m.cli.ask(op="decode", ids=ids, skip_special_tokens=True) == {"text": want}
        assert (want == "don't, isn't. I'm here! ok?") is force
    finally:
        m.cli.close()


# ---------------------------------------------------------------------------- detokenizer
def _python_detok(tok, steps, finish, stops, skip):
    detok = Detokenizer(tok)
    state = DecodeState(stops=tuple(stops), skip_special_tokens=skip)
    pieces, hit, counts = [], False, []
    for i, ids in enumerate(steps):
        reason = finish if i == len(steps) - 1 else None
        (_, text, stop_hit), = detok.update([(state, list(ids), reason)])  # fmt: skip
        pieces.append(text)
        counts.append(state.unsent_tokens)
        hit |= stop_hit
        if state.finished is not None:
            break
    return {"pieces": pieces, "finished": state.finished, "stop_hit": hit, "text": state.text,
            "unsent_tokens": counts}  # fmt: skip


@st.composite
def detok_cases(draw, tok):
    n = len(tok)
    source = draw(st.sampled_from(["unicode", "random", "mixed"]))
    if source == "random":
        ids = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=30))
    else:
        text = draw(st.sampled_from(TEXTS[2:10])) + draw(st.text(max_size=10))
        ids = tok([text], add_special_tokens=False)["input_ids"][0][:40] or [0]
        if source == "mixed":
            extra = draw(st.lists(st.integers(0, n - 1), max_size=5))
            at = draw(st.integers(0, len(ids)))
            ids = ids[:at] + extra + ids[at:]
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(ids) - 1)), max_size=len(ids))))
    steps = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True) if a < b]
    full = tok.decode(ids)
    stops = []
    for _ in range(draw(st.integers(0, 3))):
        if full and draw(st.booleans()):
            a = draw(st.integers(0, len(full) - 1))
            stops.append(full[a : a + draw(st.integers(1, 4))])
        else:
            stops.append(draw(st.text(min_size=1, max_size=3)))
    finish = draw(st.sampled_from([None, "length"]))
    return steps, finish, stops, draw(st.booleans())


@SETTINGS
@given(data=st.data())
def test_detokenizer_matches_python(model, data):
    steps, finish, stops, skip = data.draw(detok_cases(model.tok))
    got = model.cli.ask(op="detok", steps=steps, finish=finish, stops=stops,
                        skip_special_tokens=skip)  # fmt: skip
    want = _python_detok(model.tok, steps, finish, stops, skip)
    assert got == want
    assert "".join(got["pieces"]) == got["text"] or got["finished"] is None


def test_detokenizer_stop_across_tokens_and_split_utf8(model):
    ids = _ids(model.tok, "Hello 😀 world, 你好!", False)
    steps = [[t] for t in ids]
    for stops in [["world"], ["o 😀 w"], ["😀"], ["好"], ["zzz"], ["d,", "llo"]]:
        got = model.cli.ask(op="detok", steps=steps, finish="length", stops=stops,
                            skip_special_tokens=True)  # fmt: skip
        assert got == _python_detok(model.tok, steps, "length", stops, True), stops
        assert "".join(got["pieces"]) == got["text"]
        if stops != ["zzz"]:
            assert got["stop_hit"] and got["finished"] == "stop"
            assert not any(s in got["text"] for s in stops)


# Chat templates in the style of the model families users serve (their control flow, filters,
# string methods and raise_exception calls), rendered by jinja2 and by minijinja.
MODEL_STYLE_TEMPLATES = {
    # Qwen2.5 (no tools)
    "qwen25": "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {{- \"# Tools\\n\" }}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n",
    # Qwen3 (think blocks, reversed slices)
    "qwen3": "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n    {%- endif %}\n{%- endfor %}\n{%- for message in messages %}\n    {%- if message.content is string %}\n        {%- set content = message.content %}\n    {%- else %}\n        {%- set content = '' %}\n    {%- endif %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role == \"system\" %}\n        {{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}\n    {%- elif message.role == \"assistant\" %}\n        {%- set reasoning_content = '' %}\n        {%- if message.reasoning_content is string %}\n            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n            {%- if '</think>' in content %}\n                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n            {%- endif %}\n        {%- endif %}\n        {%- if loop.index0 > ns.last_query_index %}\n            {%- if loop.last or (not loop.last and reasoning_content) %}\n                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n            {%- else %}\n                {{- '<|im_start|>' + message.role + '\\n' + content }}\n            {%- endif %}\n        {%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n        {{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}\n",
    # Mistral (role alternation)
    "mistral": "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content'] %}\n    {%- set loop_messages = messages[1:] %}\n{%- else %}\n    {%- set loop_messages = messages %}\n{%- endif %}\n\n{{- bos_token }}\n{%- for message in loop_messages %}\n    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}\n    {%- endif %}\n    {%- if message['role'] == 'user' %}\n        {%- if loop.first and system_message is defined %}\n            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n        {%- else %}\n            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n        {%- endif %}\n    {%- elif message['role'] == 'assistant' %}\n        {{- ' ' + message['content'] + eos_token}}\n    {%- else %}\n        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}\n    {%- endif %}\n{%- endfor %}\n",
    # Llama 3.2 (strftime_now, trim)
    "llama32": "{{- bos_token }}\n{%- if not date_string is defined %}\n    {%- if strftime_now is defined %}\n        {%- set date_string = strftime_now(\"%d %b %Y\") %}\n    {%- else %}\n        {%- set date_string = \"26 Jul 2024\" %}\n    {%- endif %}\n{%- endif %}\n{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content']|trim %}\n    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = \"\" %}\n{%- endif %}\n{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n{{- system_message }}\n{{- \"<|eot_id|>\" }}\n{%- for message in messages %}\n    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n",
}
MODEL_STYLE_CHATS = [
    *CHATS,
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "<think>\nr\n</think>\n\na1"},
        {"role": "user", "content": "u2"},
    ],
    [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "t1"},
        {"role": "tool", "content": "t2"},
        {"role": "user", "content": "<tool_response>x</tool_response>"},
    ],
    [{"role": "user", "content": "u"}, {"role": "user", "content": "u again"}],
    [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
    ],
]


@pytest.mark.parametrize("name", sorted(MODEL_STYLE_TEMPLATES))
def test_model_style_templates_match_hf(name, tiny_dir, tmp_path, service_bin):
    path = _with_config(tiny_dir, tmp_path / name, chat_template=MODEL_STYLE_TEMPLATES[name])
    m = Model(path, service_bin)
    try:
        errors = 0
        for msgs in MODEL_STYLE_CHATS:
            try:
                text = m.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
                want = {"text": text, "ids": _ids(m.tok, text, False)}
            except Exception as e:  # the template's raise_exception
                want = {"error": str(e)}
                errors += 1
            assert m.cli.ask(op="chat", messages=msgs) == want, msgs
        assert errors == (3 if name == "mistral" else 0)
    finally:
        m.cli.close()
