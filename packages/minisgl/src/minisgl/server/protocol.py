"""OpenAI request validation: JSON body -> (prompt, WireParams, stream options) or APIError."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from minisgl.chat import ChatError, parse_messages
from minisgl.core import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    PRIORITY_RANGE,
    SEED_RANGE,
    choice_seed,
)
from minisgl.message.schema import WireParams
from minisgl.scheduler.request import RequestError, check_max_tokens
from minisgl.tools.spec import ToolChoice, ToolError, ToolUse, parse_tool_choice, parse_tools

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "ignore_eos",
    "stream",
    "stream_options",
    "n",
    "stop_token_ids",
    "skip_special_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
    "min_tokens",
    "response_format",
    "priority",
}
CHAT = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                 "chat_template_kwargs",
                 "tool_choice", "parallel_tool_calls"}  # fmt: skip
COMPLETION = COMMON | {"prompt", "logprobs"}
MAX_LOGPROBS = 20

# accepted only with these (default) values: anything else is a clear 400
DEFAULT_ONLY: dict[str, tuple] = {
    "echo": (False, None),
    "best_of": (1, None),
    "suffix": (None,),
    "tools": (None,),
    "tool_choice": (None, "none"),
    "functions": (None,),
    "function_call": (None, "none"),
}
# parallel_tool_calls: validated on chat (with tools), ignored on completions as before
IGNORED = {"user", "store", "metadata", "service_tier", "parallel_tool_calls"}


INT64 = 2**63


class ModelNames(frozenset):
    """The names a request's `model` may give (a set of them): the served name(s), the only
    ones a response shows (`served`), and aliases accepted but never shown (the model path)."""

    served: tuple[str, ...]

    def __new__(cls, served: Collection[str], aliases: Collection[str] = ()) -> ModelNames:
        self = super().__new__(cls, (*served, *aliases))
        self.served = tuple(served)
        return self


@dataclass
class Parsed:
    kind: str  # text | ids | chat
    prompt: Any
    params: WireParams
    stream: bool
    include_usage: bool
    model: str
    n: int = 1
    continuous_usage: bool = False
    tools: ToolUse | None = None  # chat with tools or earlier tool calls: rendered by the server
    template_kwargs: dict | None = None  # chat_template_kwargs (rendered by the server)

    def choice_params(self, uids: list[int]) -> list[WireParams]:
        """The parameters of each of the n choices: a seeded request gives choice i the seed
        `seed + i` (`core.choice_seed`, as vLLM does and `LLM.generate` does)."""
        p = self.params
        if self.n == 1:
            return [p]
        return [
            dataclasses.replace(
                p,
                seed=choice_seed(p.seed, i),
                prefix_leader=uids[0] if i else 0,
            )
            for i in range(len(uids))
        ]


def check_transportable(body: Any) -> None:
    """Every string must be valid Unicode (no lone surrogates) and every integer fit in 64
    bits: such a body is a 400 naming its top-level field, never a failure after admission."""
    stack: list[tuple[Any, str | None]] = [(body, None)]
    while stack:
        v, key = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                where = f"'{key}'" if key else "the body"
                raise _bad(
                    f"{where} contains a lone UTF-16 surrogate (not valid Unicode)", key
                ) from None
        elif isinstance(v, int) and not isinstance(v, bool):
            if not -INT64 <= v < INT64:
                where = f"'{key}'" if key else "the body"
                raise _bad(f"{where} contains an integer outside the 64-bit range", key)
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, key or k if isinstance(k, str) else key))
                stack.append((x, key or k))
        elif isinstance(v, list):
            stack.extend((x, key) for x in v)


def _bad(msg: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, msg, param, code)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(body: dict, key: str, default: float, lo: float, hi: float, lo_open=False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        raise _bad(f"'{key}' must be a number, got {type(v).__name__}", key, "invalid_type")
    if v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise _bad(f"'{key}' must be in {left}{lo}, {hi}], got {v}", key)
    return float(v)


def _check_fields(body: dict, allowed: set[str]) -> None:
    for k, v in body.items():
        if k in allowed or k in IGNORED:
            continue
        if k in DEFAULT_ONLY:
            ok = DEFAULT_ONLY[k]
            if v in ok or (k == "tools" and not v):
                continue
            raise _bad(
                f"'{k}' is not supported by this server (got {v!r})", k, "unsupported_parameter"
            )
        raise _bad(f"unsupported parameter '{k}'", k, "unsupported_parameter")


def parse_common(
    body: Any,
    allowed: set[str],
    model_names: ModelNames | Collection[str],
    max_seq_len: int,
    default_max_tokens: int,
) -> Common:
    """`model_names`: a `ModelNames`, or names that are all served (and all shown)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_type")
    check_transportable(body)
    _check_fields(body, allowed)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model", "invalid_type")
    if model is not None and model not in model_names:
        served = getattr(model_names, "served", None) or sorted(model_names)
        raise APIError(
            404,
            f"the model '{model}' does not exist; this server serves "
            + ", ".join(f"'{name}'" for name in served),
            "model",
            "model_not_found",
        )
    n = body.get("n")
    if n is None:
        n = 1
    elif not _is_int(n):
        raise _bad(f"'n' must be an integer, got {type(n).__name__}", "n", "invalid_type")
    elif not 1 <= n <= MAX_N:
        raise _bad(f"'n' must be in [1, {MAX_N}], got {n}", "n")
    max_tokens = body.get("max_completion_tokens")
    key = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, key = body.get("max_tokens"), "max_tokens"
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif not _is_int(max_tokens):
        raise _bad(
            f"'{key}' must be an integer, got {type(max_tokens).__name__}", key, "invalid_type"
        )
    else:
        try:
            check_max_tokens(max_tokens, max_seq_len, key)  # LLM.generate's check as well
        except RequestError as e:
            raise _bad(str(e), key) from None
    temperature = _num(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE)
    top_p = _num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = body.get("top_k")
    if top_k is None:
        top_k = -1
    elif not _is_int(top_k):
        raise _bad("'top_k' must be an integer", "top_k", "invalid_type")
    elif top_k < -1:
        raise _bad(f"'top_k' must be -1 (off) or >= 0, got {top_k}", "top_k")
    presence = _num(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _num(body, "frequency_penalty", 0.0, -2.0, 2.0)
    repetition = _num(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True)
    min_p = _num(body, "min_p", 0.0, 0.0, 1.0)
    min_tokens = body.get("min_tokens")
    if min_tokens is None:
        min_tokens = 0
    elif not _is_int(min_tokens):
        raise _bad("'min_tokens' must be an integer", "min_tokens", "invalid_type")
    elif not 0 <= min_tokens <= max_tokens:
        raise _bad(
            f"'min_tokens' must be in [0, max_tokens={max_tokens}], got {min_tokens}", "min_tokens"
        )
    logit_bias = _logit_bias(body.get("logit_bias"))
    logprobs = _logprobs(body, "top_logprobs" if "messages" in allowed else "logprobs")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _bad("'seed' must be an integer", "seed", "invalid_type")
    if seed is not None and not 0 <= seed < SEED_RANGE:
        raise _bad("'seed' must be in [0, 2**63)", "seed")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if any(s == "" for s in stops):
        raise _bad("'stop' strings must not be empty", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad(f"at most {MAX_STOP_STRINGS} 'stop' strings are supported", "stop")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (
        isinstance(stop_ids, list) and all(_is_int(t) for t in stop_ids)
    ):
        raise _bad("'stop_token_ids' must be a list of integers", "stop_token_ids", "invalid_type")
    for key in ("ignore_eos", "stream", "skip_special_tokens"):
        v = body.get(key)
        if v is not None and not isinstance(v, bool):
            raise _bad(f"'{key}' must be a boolean", key, "invalid_type")
    stream = bool(body.get("stream"))
    opts = body.get("stream_options")
    include_usage = continuous_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
        if not stream:
            raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        unknown = set(opts) - {"include_usage", "continuous_usage_stats"}
        cus = opts.get("continuous_usage_stats", False)
        if not isinstance(cus, bool):
            raise _bad(
                "'stream_options.continuous_usage_stats' must be a boolean",
                "stream_options",
                "invalid_type",
            )
        continuous_usage = cus
        if unknown:
            raise _bad(
                f"unsupported stream_options {sorted(unknown)}",
                "stream_options",
                "unsupported_parameter",
            )
        iu = opts.get("include_usage", False)
        if not isinstance(iu, bool):
            raise _bad(
                "'stream_options.include_usage' must be a boolean", "stream_options", "invalid_type"
            )
        include_usage = iu
    response_format = _response_format(body.get("response_format"), body.get("ignore_eos"))
    params = WireParams(
        response_format=response_format,
        priority=_priority(body),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_tokens=max_tokens,
        ignore_eos=bool(body.get("ignore_eos", False)),
        seed=seed,
        stop=stops,
        stop_token_ids=stop_ids,
        skip_special_tokens=body.get("skip_special_tokens", True) is not False,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        min_p=min_p,
        logit_bias=logit_bias,
        min_tokens=min_tokens,
        logprobs=logprobs,
    )
    return Common(params, stream, include_usage, continuous_usage, model or "", n)


@dataclass(frozen=True)
class Common:
    """What both endpoints share, validated."""

    params: WireParams
    stream: bool
    include_usage: bool
    continuous_usage: bool
    model: str
    n: int

    def parsed(self, kind: str, prompt: Any, tools: ToolUse | None = None) -> Parsed:
        return Parsed(
            kind,
            prompt,
            self.params,
            self.stream,
            self.include_usage,
            self.model,
            self.n,
            self.continuous_usage,
            tools,
        )


def _logprobs(body: dict, key: str) -> int | None:
    """Chat: `logprobs` (bool) and `top_logprobs` (0..20); completions: `logprobs` (0..20)."""
    if key == "top_logprobs":
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise _bad("'logprobs' must be a boolean", "logprobs", "invalid_type")
        top = body.get("top_logprobs")
        if top is not None and not on:
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if not on:
            return None
    else:
        top = body.get("logprobs")
        if top is None:
            return None
        if isinstance(top, bool):  # the chat form: true could mean 0 or 1 more; not guessed
            raise _bad(
                "'logprobs' on /v1/completions is the number of top logprobs per token, an "
                f"integer in [0, {MAX_LOGPROBS}]; got {str(top).lower()} (a boolean 'logprobs' "
                "with 'top_logprobs' is /v1/chat/completions' form)",
                "logprobs",
                "invalid_type",
            )
    if top is None:
        return 0
    if not _is_int(top):
        raise _bad(f"'{key}' must be an integer", key, "invalid_type")
    if not 0 <= top <= MAX_LOGPROBS:
        raise _bad(f"'{key}' must be in [0, {MAX_LOGPROBS}], got {top}", key)
    return top


def _priority(body: dict) -> int:
    """The request's `priority` (vLLM's field: lower is served sooner; default 0)."""
    v = body.get("priority", 0)
    lo, hi = PRIORITY_RANGE
    if not _is_int(v) or not lo <= v <= hi:
        raise _bad(f"'priority' must be an integer in [{lo}, {hi}], got {v!r}", "priority")
    return v


def check_priority(params: WireParams, policy: str) -> None:
    """A `priority` other than 0 needs the server's priority scheduling (a 400 naming the
    flag: without it the field would be silently ignored)."""
    if params.priority != 0 and policy != "priority":
        raise _bad(
            f"'priority' needs a server started with --scheduling-policy priority (this one "
            f"runs {policy})",
            "priority",
            "unsupported_parameter",
        )


def _response_format(v: Any, ignore_eos: Any) -> str | None:
    """The validated response_format as JSON for the wire (None: plain text)."""
    if v is None:
        return None
    from minisgl.structured import ResponseFormat

    try:
        fmt = ResponseFormat.parse(v)
    except ValueError as exc:
        raise _bad(str(exc), "response_format") from None
    if fmt is None:
        return None
    if ignore_eos:
        raise _bad(
            "response_format cannot combine with ignore_eos: a constrained output ends with EOS "
            "once the grammar is complete",
            "response_format",
        )
    return json.dumps(v)  # keys in the client's order: a schema's properties keep theirs


def _logit_bias(v: Any) -> list[list] | None:
    """OpenAI's {"token id": bias in [-100, 100]} (the vocabulary is checked by the engine)."""
    if v is None or v == {}:
        return None
    if not isinstance(v, dict):
        raise _bad(
            "'logit_bias' must be an object of token id -> bias", "logit_bias", "invalid_type"
        )
    if len(v) > MAX_LOGIT_BIAS:
        raise _bad(f"at most {MAX_LOGIT_BIAS} 'logit_bias' entries are supported", "logit_bias")
    out = []
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10):
            raise _bad(f"'logit_bias' keys must be token ids, got {k!r}", "logit_bias")
        if not isinstance(b, int | float) or isinstance(b, bool) or not math.isfinite(b):
            raise _bad(
                f"'logit_bias' values must be numbers, got {b!r}", "logit_bias", "invalid_type"
            )
        if not -100 <= b <= 100:
            raise _bad(f"'logit_bias' values must be in [-100, 100], got {b}", "logit_bias")
        out.append([int(k), float(b)])
    return out


def check_text_length(chars: int, max_seq_len: int, max_token_chars: int, param: str) -> None:
    """Refuse, before tokenizing it, a text that cannot fit the context whatever its tokens."""
    if max_token_chars > 0 and chars > max_seq_len * max_token_chars:
        raise APIError(
            400,
            f"the prompt has {chars} characters: more than the {max_seq_len}-token context can "
            f"hold (at most {max_token_chars} characters per token); refused before tokenizing",
            param,
            "context_length_exceeded",
        )


def parse_chat(
    body: Any, model_names: ModelNames | Collection[str], max_seq_len: int, max_token_chars: int = 0
) -> Parsed:
    common = parse_common(body, CHAT, model_names, max_seq_len, max_seq_len)
    try:
        out = parse_messages(body.get("messages"))
    except ChatError as exc:
        raise _bad(str(exc), exc.param, exc.code) from None
    chars = sum(len(m["content"]) for m in out)
    check_text_length(chars, max_seq_len, max_token_chars, "messages")
    tools = _tool_use(body, common, any("tool_calls" in m for m in out))
    parsed = common.parsed("chat", out, tools)
    parsed.template_kwargs = _template_kwargs(body.get("chat_template_kwargs"))
    return parsed


# apply_chat_template's own arguments: never passed on from a request's chat_template_kwargs
TEMPLATE_RESERVED = frozenset({"conversation", "messages", "tools", "documents",
    "add_generation_prompt", "continue_final_message", "tokenize", "return_dict",
    "return_tensors", "padding", "truncation", "max_length", "chat_template",
    "tokenizer_kwargs", "return_assistant_tokens_mask"})  # fmt: skip


def _template_kwargs(v: Any) -> dict | None:
    """`chat_template_kwargs`: extra variables of the chat template (`{"enable_thinking":
    false}`); an object whose keys are not the renderer's own arguments."""
    if v is None or v == {}:
        return None
    if not isinstance(v, dict):
        raise _bad("'chat_template_kwargs' must be an object", "chat_template_kwargs",
                   "invalid_type")  # fmt: skip
    taken = sorted(TEMPLATE_RESERVED.intersection(v))
    if taken:
        raise _bad(
            f"'chat_template_kwargs' cannot set {', '.join(taken)} (the request's own fields)",
            "chat_template_kwargs",
        )
    return dict(v)


def _tool_use(body: dict, common: Common, history_calls: bool) -> ToolUse | None:
    """The request's tools and tool_choice (None: a plain chat the tokenizer renders)."""
    try:
        tools = parse_tools(body.get("tools"))
        choice = parse_tool_choice(body.get("tool_choice"), tools, body.get("parallel_tool_calls"))
    except ToolError as exc:
        raise _bad(str(exc), exc.param) from None
    if not tools and not history_calls:
        return None
    if choice.mode != "none":
        if common.params.response_format is not None:
            raise _bad(
                "response_format cannot combine with tools unless tool_choice is 'none' (the "
                "tool calls have their own grammar)",
                "response_format",
            )
        if common.params.ignore_eos:
            raise _bad("ignore_eos cannot combine with tools: a tool call ends with EOS", "tools")
    return ToolUse(tools, choice if tools else ToolChoice("none"))


def parse_completion(
    body: Any, model_names: ModelNames | Collection[str], max_seq_len: int, max_token_chars: int = 0
) -> Parsed:
    common = parse_common(body, COMPLETION, model_names, max_seq_len, 16)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if prompt == "":  # no token to start from (refused here: the same answer on every backend)
        raise _bad("prompt is empty: at least one token is required", "prompt")
    if isinstance(prompt, str):
        check_text_length(len(prompt), max_seq_len, max_token_chars, "prompt")
        return common.parsed("text", prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return common.parsed("ids", prompt)
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str | list) for p in prompt)
    ):
        raise _bad(
            "batched prompts are not supported: send one prompt per request",
            "prompt",
            "unsupported_parameter",
        )
    raise _bad(
        "'prompt' must be a string or a non-empty list of token ids",
        "prompt",
        "invalid_type" if prompt is not None else "missing_required_parameter",
    )
