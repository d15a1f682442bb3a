"""OpenAI request validation: JSON body -> (prompt, WireParams, stream options) or APIError."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from minisgl import sampling_fields as table
from minisgl.chat import ChatError, parse_messages
from minisgl.core import choice_seed
from minisgl.message.schema import WireParams
from minisgl.sampling_fields import CONTEXT, INT64, MAX_LOGPROBS, Field, ParamError
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


# the fields each endpoint reads, ignores, or takes only with their default values: all
# from the one table of request parameters (`minisgl.sampling_fields`)
CHAT = table.accepted("chat")
COMPLETION = table.accepted("completions")
IGNORED = table.ignored("chat") | table.ignored("completions")


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


def _check_fields(body: dict, endpoint: str) -> None:
    allowed, ignored = table.accepted(endpoint), table.ignored(endpoint)
    default_only = table.default_only(endpoint)
    for k, v in body.items():
        if k in allowed or k in ignored:
            continue
        if k in default_only:
            if v in default_only[k]:
                continue
            raise _bad(
                f"'{k}' is not supported by this server (got {v!r})", k, "unsupported_parameter"
            )
        raise _bad(f"unsupported parameter '{k}'", k, "unsupported_parameter")


def _value(body: dict, f: Field, endpoint: str, key: str | None = None) -> Any:
    """The request's value of a field, checked by the table (absent, or null where the table makes null its default: the default)."""
    v = body.get(key or f.name)
    if v is None and (f.null_is_default or (key or f.name) not in body):
        return f.default_for(endpoint)
    try:
        return f.check(v, key)
    except ParamError as e:
        raise _bad(str(e), e.param, e.code) from None


# wire fields `parse_common` reads itself: a bound on another field, an endpoint's own form
_OWN = {"max_tokens", "min_tokens", "logprobs", "logit_bias", "response_format", "prefix_leader"}


def parse_common(
    body: Any, allowed: set[str], model_names: ModelNames | Collection[str], max_seq_len: int
) -> Common:
    """The fields both endpoints share, read as the table (`minisgl.sampling_fields`) defines
    them. `allowed`: `CHAT` or `COMPLETION`; `model_names`: a `ModelNames`, or names that are
    all served (and all shown)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_type")
    endpoint = "chat" if allowed == CHAT else "completions"
    check_transportable(body)
    _check_fields(body, endpoint)
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
    fields = table.fields_for(endpoint)
    n = _value(body, fields["n"], endpoint)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    max_tokens = _value(body, fields[key or "max_tokens"], endpoint)
    if max_tokens == CONTEXT:
        max_tokens = max_seq_len
    try:
        check_max_tokens(max_tokens, max_seq_len, key or "max_tokens")  # LLM.generate's too
    except RequestError as e:
        raise _bad(str(e), key or "max_tokens") from None
    wire = {
        name: _value(body, f, endpoint)
        for name, f in fields.items()
        if f.wire is not None and name not in _OWN
    }
    min_tokens = _value(body, fields["min_tokens"], endpoint)
    try:
        table.check_min_tokens(min_tokens, max_tokens)
    except ParamError as e:
        raise _bad(str(e), e.param, e.code) from None
    wire["stop"] = list(wire["stop"] or ())
    if wire["stop_token_ids"] is not None:
        wire["stop_token_ids"] = list(wire["stop_token_ids"])
    stream = _value(body, fields["stream"], endpoint)
    include_usage, continuous_usage = _stream_options(body.get("stream_options"), stream)
    params = WireParams(
        **wire,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        logit_bias=_logit_bias(body.get("logit_bias"), fields["logit_bias"]),
        logprobs=_logprobs(body, endpoint),
        response_format=_response_format(body.get("response_format"), wire["ignore_eos"]),
    )
    return Common(params, stream, include_usage, continuous_usage, model or "", n)


def _stream_options(opts: Any, stream: bool) -> tuple[bool, bool]:
    """`stream_options`: (include_usage, continuous_usage_stats)."""
    if opts is None:
        return False, False
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
    return iu, cus


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


def _logprobs(body: dict, endpoint: str) -> int | None:
    """Chat: `logprobs` (bool) and `top_logprobs` (0..20); completions: `logprobs` (0..20)."""
    fields = table.fields_for(endpoint)
    if endpoint == "chat":
        on = _value(body, fields["logprobs"], endpoint)
        top = _value(body, fields["top_logprobs"], endpoint)
        if top is not None and not on:
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if on else None
    top = body.get("logprobs")
    if isinstance(top, bool):  # the chat form: true could mean 0 or 1 more; not guessed
        raise _bad(
            "'logprobs' on /v1/completions is the number of top logprobs per token, an "
            f"integer in [0, {MAX_LOGPROBS}]; got {str(top).lower()} (a boolean 'logprobs' "
            "with 'top_logprobs' is /v1/chat/completions' form)",
            "logprobs",
            "invalid_type",
        )
    return _value(body, fields["logprobs"], endpoint)


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
        raise _bad(table.RESPONSE_FORMAT_WITH_IGNORE_EOS, "response_format")
    return json.dumps(v)  # keys in the client's order: a schema's properties keep theirs


def _logit_bias(v: Any, f: Field) -> list[list] | None:
    """OpenAI's {"token id": bias}, checked as the table checks `SamplingParams.logit_bias`
    once its keys are ints (the vocabulary is checked by the engine)."""
    if v is None or v == {}:
        return None
    try:
        if not isinstance(v, dict):
            raise table.not_a_mapping(v)
        for k in v:
            if not (k.isascii() and k.isdigit() and len(k) <= 10):
                raise ParamError(f"logit_bias keys must be token ids (ints >= 0), got {k!r}",
                                 "logit_bias")  # fmt: skip
        pairs = f.check({int(k): b for k, b in v.items()})
    except ParamError as e:
        raise _bad(str(e), e.param, e.code) from None
    return [[t, b] for t, b in pairs]


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
    common = parse_common(body, CHAT, model_names, max_seq_len)
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
    common = parse_common(body, COMPLETION, model_names, max_seq_len)
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
