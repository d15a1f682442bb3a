"""Bad request bodies and the answer each must get (status, param, code): shared by the
server tests of every CPU backend, so the python and rust_service paths are held to one list."""

from __future__ import annotations

LONG_IDS = list(range(3, 303))  # 300 tokens > the 256-token context

CHAT = [{"role": "user", "content": "hi"}]
CASES = [
    # (endpoint, body, status, param, code)
    ("chat", {"messages": CHAT, "max_tokens": "10"}, 400, "max_tokens", "invalid_type"),
    ("chat", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens", None),
    ("chat", {"messages": CHAT, "max_tokens": -5}, 400, "max_tokens", None),
    ("chat", {"messages": CHAT, "max_tokens": 10**6}, 400, "max_tokens", None),
    ("chat", {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    ("chat", {"messages": CHAT, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("chat", {"messages": CHAT, "temperature": 7}, 400, "temperature", None),
    ("chat", {"messages": CHAT, "top_p": 0}, 400, "top_p", None),
    ("chat", {"messages": CHAT, "top_k": 1.5}, 400, "top_k", "invalid_type"),
    ("chat", {"messages": CHAT, "seed": "x"}, 400, "seed", "invalid_type"),
    ("chat", {"messages": CHAT, "stop": 5}, 400, "stop", "invalid_type"),
    ("chat", {"messages": CHAT, "stop": [""]}, 400, "stop", None),
    ("chat", {"messages": CHAT, "stream": "yes"}, 400, "stream", "invalid_type"),
    (
        "chat",
        {"messages": CHAT, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        None,
    ),
    ("chat", {"messages": CHAT, "n": 0}, 400, "n", None),
    ("chat", {"messages": CHAT, "n": 1000}, 400, "n", None),
    ("chat", {"messages": CHAT, "presence_penalty": 2.5}, 400, "presence_penalty", None),
    ("chat", {"messages": CHAT, "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ("chat", {"messages": CHAT, "min_p": 1.5}, 400, "min_p", None),
    ("chat", {"messages": CHAT, "min_tokens": 50, "max_tokens": 5}, 400, "min_tokens", None),
    ("chat", {"messages": CHAT, "logit_bias": {"x": 1}}, 400, "logit_bias", None),
    ("chat", {"messages": CHAT, "logit_bias": {"5": 101}}, 400, "logit_bias", None),
    ("chat", {"messages": CHAT, "logit_bias": {"999999": 1}}, 400, "logit_bias", None),
    (
        "chat",
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}]},
        400,
        "messages[0].tool_calls",
        "invalid_value",  # a call without its function (issue 38: tool calls are accepted)
    ),
    ("chat", {"messages": CHAT, "logprobs": 3}, 400, "logprobs", "invalid_type"),
    ("chat", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs", None),
    ("chat", {"messages": CHAT, "frequency_penalty": -3}, 400, "frequency_penalty", None),
    ("chat", {"messages": CHAT, "foo": 1}, 400, "foo", "unsupported_parameter"),
    ("chat", {"messages": "hi"}, 400, "messages", "invalid_type"),
    ("chat", {"messages": []}, 400, "messages", None),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
    (
        "chat",
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
        "invalid_type",
    ),
    ("chat", {"messages": CHAT, "model": "gpt-4"}, 404, "model", "model_not_found"),
    (
        "chat",
        {"messages": [{"role": "user", "content": "fox " * 400}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("completions", {"prompt": LONG_IDS}, 400, "prompt", "context_length_exceeded"),
    ("completions", {"prompt": LONG_IDS, "stream": True}, 400, "prompt", "context_length_exceeded"),
    ("completions", {"prompt": [1, 2, 10**6]}, 400, "prompt", None),
    ("completions", {"prompt": [1, -2]}, 400, "prompt", None),
    ("completions", {"prompt": {"text": "x"}}, 400, "prompt", "invalid_type"),
    ("completions", {}, 400, "prompt", "missing_required_parameter"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt", "unsupported_parameter"),
    ("completions", {"prompt": "hi", "echo": True}, 400, "echo", "unsupported_parameter"),
    ("completions", {"prompt": "hi", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("completions", {"prompt": "hi", "n": 3.5}, 400, "n", "invalid_type"),
    ("completions", {"prompt": "hi", "model": "nope"}, 404, "model", "model_not_found"),
]

# Bodies that used to pass validation and then fail after the request was registered (a 500
# whose in-flight slot was never released: ~320 of them locked every client out with 429s).
POISON = [
    ("completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("chat", b'{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 2}', None),
    ("completions", b'{"prompt": [1, 18446744073709551616], "max_tokens": 2}', "prompt"),
    ("completions", b'{"prompt": "hi", "top_k": 18446744073709551617}', "top_k"),
    ("completions", b'{"prompt": "hi", "stop_token_ids": [18446744073709551616]}', None),
    ("chat", b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}', "stop"),
]
