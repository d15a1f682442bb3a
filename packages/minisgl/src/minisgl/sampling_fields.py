"""The request parameters, defined once (issue 64 item 1): one `Field` a parameter, giving its
type, range, defaults and the endpoints that accept it (`chat`, `completions`, `offline`).

Everything else reads this table instead of restating it: `core.SamplingParams` validates with
it, the HTTP parser (`server/protocol.py`) takes its fields, ranges and defaults from it,
`/openapi.json` (`server/openapi.py`) is generated from it, `message.schema.WireParams` travels
in its `WIRE_FIELDS` order, and the Rust service's own reader of that layout (`wire.rs`) and its
vocabulary checks are tested against it (`tests/test_sampling_fields.py`).

One bad value, one message: a refused value is a `ParamError`, a `ValueError` naming the field
whose message is both the offline error and the server's 400 (with `param` and `code`).

The bottom layer: this module imports nothing of minisgl's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Literal

Endpoint = Literal["chat", "completions", "offline"]
Kind = Literal[
    "number", "int", "bool", "string", "object", "array", "stop", "token_ids", "logit_bias",
    "messages", "prompt", "stream_options", "tool_choice",
]  # fmt: skip
HTTP: frozenset[str] = frozenset({"chat", "completions"})
ALL: frozenset[str] = HTTP | {"offline"}
NONE: frozenset[str] = frozenset()

INT64 = 2**63  # a JSON integer outside [-2**63, 2**63) is refused before any field is read
SEED_RANGE = 2**63  # seeds are in [0, 2**63)
MAX_TEMPERATURE = 2.0
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 1024
MAX_LOGPROBS = 20
LOGIT_BIAS_RANGE = (-100.0, 100.0)
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # a request's priority (lower first: vLLM's sign)
CONTEXT = "context"  # a default or bound that is the server's context length
RESPONSE_FORMAT_WITH_IGNORE_EOS = (
    "response_format cannot combine with ignore_eos: a constrained output ends with EOS once "
    "the grammar is complete"
)


class ParamError(ValueError):
    """A parameter's value cannot be taken: the offline `ValueError`, and the server's 400 with
    `param` (the field) and `code` (`invalid_type` or `invalid_value`)."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


def is_int(v: Any, kind: type = int) -> bool:
    return isinstance(v, kind) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def as_items(v: Any) -> tuple | None:
    """A list's or tuple's items (numpy arrays and other sequences too); None for anything
    else (a string, a number, a mapping)."""
    if isinstance(v, str | bytes | Mapping) or not hasattr(v, "__len__"):
        return None
    try:
        return tuple(v)
    except TypeError:
        return None


def type_name(v: Any, want: Any) -> str:
    """What `v` is, for an error: its type, or for a list the type of its first item that is
    not `want`."""
    items = as_items(v)
    if items is None:
        return type(v).__name__
    bad = next((x for x in items if not isinstance(x, want) or isinstance(x, bool)), None)
    return f"a list holding {type(bad).__name__}"


def _fmt(x: float) -> str:
    if x == 2**63:
        return "2**63"
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class Range:
    """Bounds of a number (None: unbounded on that side)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    as_bounds: bool = False  # said ">= lo and <= hi" rather than "in [lo, hi]"

    def __contains__(self, v: float) -> bool:
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        if self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)):
            return False
        return not math.isnan(v)

    def describe(self) -> str:
        lo = None if self.lo is None else f"{'>' if self.lo_open else '>='} {_fmt(self.lo)}"
        hi = None if self.hi is None else f"{'<' if self.hi_open else '<='} {_fmt(self.hi)}"
        if self.as_bounds or self.lo is None or self.hi is None:
            return " and ".join(s for s in (lo, hi) if s)
        left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        return f"in {left}{_fmt(self.lo)}, {_fmt(self.hi)}{right}"


_SAME: Any = object()  # `Field.server_default`: the server's default is the offline one


@dataclass(frozen=True, eq=False)  # compared by identity: its defaults may be lists
class Field:
    """One request parameter.

    `endpoints`: where it is read; `ignored`: where it is accepted and has no effect;
    `default_only`: elsewhere it is accepted only with one of these values (a clear 400
    otherwise). `default` is `SamplingParams`' (offline); `server_default` the server's when it
    differs (a mapping endpoint -> default where the endpoints differ; `CONTEXT`: the context
    length). `context_bound`: at most the context length. `wire`: its index in the parameters
    as they travel between processes (`WireParams`, and the Rust service's `wire.rs`).
    """

    name: str
    kind: Kind
    default: Any = None
    endpoints: frozenset[str] = ALL
    range: Range | None = None
    server_default: Any = _SAME
    nullable: bool = False  # None is a value of it ("must be None or an int")
    null_is_default: bool = True  # a request's null means its default (False: refused)
    max_items: int | None = None
    context_bound: bool = False
    required: bool = False
    range_in_type: bool = False  # every error of it says "an int in [lo, hi]"
    ignored: frozenset[str] = NONE
    default_only: tuple = ()
    wire: int | None = None
    doc: str = ""

    def default_for(self, endpoint: str) -> Any:
        d = self.server_default
        if endpoint == "offline" or d is _SAME:
            return self.default
        return d[endpoint] if isinstance(d, Mapping) else d

    @property
    def http_default(self) -> Any:
        """The server's default (both endpoints)."""
        return self.default_for("completions")

    def check(self, v: Any, key: str | None = None) -> Any:
        """`v` validated (numbers as floats, lists as tuples), or a `ParamError` naming `key`
        (the field's name unless the request spelt it otherwise)."""
        key = key or self.name
        if v is None and self.nullable:
            return None
        check = _CHECKS.get(self.kind)
        return check(self, v, key) if check else v

    def _range_error(self, v: Any, key: str, code: str) -> ParamError:
        assert self.range is not None
        if self.range_in_type:
            return ParamError(f"{key} must be an int {self.range.describe()}, got {v!r}", key, code)
        return ParamError(f"{key} must be {self.range.describe()}, got {v}", key, code)


def _check_int(f: Field, v: Any, key: str) -> int:
    if not is_int(v):
        if f.range_in_type:
            raise f._range_error(v, key, "invalid_type")
        what = "None or an int" if f.nullable else "an int"
        raise ParamError(f"{key} must be {what}, got {type(v).__name__}", key, "invalid_type")
    if f.range is not None and v not in f.range:
        raise f._range_error(v, key, "invalid_value")
    return v


def _check_number(f: Field, v: Any, key: str) -> float:
    if not is_number(v) or not math.isfinite(v):
        got = repr(v) if is_number(v) else type(v).__name__
        raise ParamError(f"{key} must be a finite number, got {got}", key, "invalid_type")
    if f.range is not None and v not in f.range:
        raise f._range_error(v, key, "invalid_value")
    return float(v)


def _check_bool(f: Field, v: Any, key: str) -> bool:
    if not isinstance(v, bool):
        raise ParamError(f"{key} must be a bool, got {type(v).__name__}", key, "invalid_type")
    return v


def _check_stop(f: Field, v: Any, key: str) -> tuple[str, ...]:
    strings = (v,) if isinstance(v, str) else () if v is None else as_items(v)
    if strings is None or any(not isinstance(s, str) for s in strings):
        raise ParamError(
            f"{key} must be a string or a list of strings, got {type_name(v, str)}",
            key,
            "invalid_type",
        )
    if any(s == "" for s in strings):
        raise ParamError(f"{key} strings must be non-empty strings", key)
    if f.max_items is not None and len(strings) > f.max_items:
        raise ParamError(f"{key} holds at most {f.max_items} strings, got {len(strings)}", key)
    return strings


def _check_token_ids(f: Field, v: Any, key: str) -> tuple[int, ...]:
    ids = as_items(v)
    if ids is None or not all(is_int(t, Integral) for t in ids):  # numpy ints too
        kind = type_name(v, Integral)
        raise ParamError(f"{key} must be a list of token ids, got {kind}", key, "invalid_type")
    return tuple(int(t) for t in ids)


def not_a_mapping(v: Any, key: str = "logit_bias") -> ParamError:
    """`logit_bias` that is not a mapping of token ids to biases (the server takes only a JSON
    object; offline a list of pairs is one too)."""
    got = type_name(v, tuple | list)
    return ParamError(
        f"{key} must be a mapping of token ids to biases, got {got}", key, "invalid_type"
    )


def _check_logit_bias(f: Field, v: Any, key: str) -> tuple[tuple[int, float], ...]:
    bias = v or ()
    items = tuple(bias.items()) if isinstance(bias, Mapping) else as_items(bias)
    if items is None or any(not isinstance(i, tuple | list) or len(i) != 2 for i in items):
        raise not_a_mapping(bias, key)
    if f.max_items is not None and len(items) > f.max_items:
        raise ParamError(f"{key} holds at most {f.max_items} entries, got {len(items)}", key)
    values = Range(*LOGIT_BIAS_RANGE)
    pairs = []
    for t, b in items:
        if not is_int(t) or t < 0:
            raise ParamError(f"{key} keys must be token ids (ints >= 0), got {t!r}", key)
        if not is_number(b) or b not in values:
            raise ParamError(f"{key} values must be numbers {values.describe()}, got {b!r}", key)
        pairs.append((t, float(b)))
    return tuple(sorted(pairs))


_CHECKS = {
    "int": _check_int,
    "number": _check_number,
    "bool": _check_bool,
    "stop": _check_stop,
    "token_ids": _check_token_ids,
    "logit_bias": _check_logit_bias,
}


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    """min_tokens is at most max_tokens (a bound no single field holds)."""
    if min_tokens > max_tokens:
        raise ParamError(
            f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}", "min_tokens"
        )


def vocab_error(token: Any, vocab: Any, field: str | None = None) -> str:
    """The message of a token id outside the vocabulary (a prompt's, or `field`'s): the Python
    engine worker's and the Rust service's (which writes the same words)."""
    where = f"{field} " if field else ""
    return f"{where}token id {token} is outside the vocabulary [0, {vocab})"


def check_vocab(token_ids: Iterable[int], vocab: int, field: str | None = None) -> None:
    """A `ParamError` (`vocab_error`) for the first id outside [0, vocab): a prompt's, or
    `field`'s (`logit_bias`' ids). The offline API's check and the engine worker's."""
    for t in token_ids:
        if not 0 <= t < vocab:
            raise ParamError(vocab_error(t, vocab, field), field or "prompt")


_TOOLS_OFF = (None, [], {}, "", False)  # `tools` on /v1/completions: only empty

# The table: every parameter a request may hold, on any endpoint.
FIELDS: tuple[Field, ...] = (
    Field("model", "string", endpoints=HTTP, doc="the served name (or the model path)"),
    Field("messages", "messages", endpoints=frozenset({"chat"}), required=True),
    Field("prompt", "prompt", endpoints=frozenset({"completions"}), required=True),
    Field("temperature", "number", 0.0, range=Range(0, MAX_TEMPERATURE, as_bounds=True),
          server_default=1.0, wire=0, doc="below 1e-5: greedy (argmax)"),
    Field("top_k", "int", -1, range=Range(-1), wire=1, doc="-1 and 0: off"),
    Field("top_p", "number", 1.0, range=Range(0, 1, lo_open=True), wire=2),
    Field("max_tokens", "int", 16, range=Range(0, lo_open=True), context_bound=True,
          server_default={"chat": CONTEXT, "completions": 16}, wire=3),
    Field("max_completion_tokens", "int", endpoints=frozenset({"chat"}),
          range=Range(0, lo_open=True), context_bound=True, doc="max_tokens' new name"),
    Field("ignore_eos", "bool", False, wire=4),
    Field("seed", "int", None, range=Range(0, SEED_RANGE, hi_open=True), nullable=True, wire=5),
    Field("stop", "stop", None, max_items=MAX_STOP_STRINGS, wire=6),
    Field("stop_token_ids", "token_ids", None, wire=7),
    Field("skip_special_tokens", "bool", True, endpoints=HTTP, wire=8),
    Field("presence_penalty", "number", 0.0, range=Range(-2, 2), wire=9),
    Field("frequency_penalty", "number", 0.0, range=Range(-2, 2), wire=10),
    Field("repetition_penalty", "number", 1.0, range=Range(0, 2, lo_open=True), wire=11),
    Field("min_p", "number", 0.0, range=Range(0, 1), wire=12),
    Field("logit_bias", "logit_bias", None, max_items=MAX_LOGIT_BIAS, wire=13),
    Field("min_tokens", "int", 0, range=Range(0), context_bound=True, wire=14,
          doc="at most max_tokens"),
    Field("logprobs", "int", None, endpoints=frozenset({"completions", "offline"}),
          range=Range(0, MAX_LOGPROBS), nullable=True, wire=15),
    Field("logprobs", "bool", False, endpoints=frozenset({"chat"})),
    Field("top_logprobs", "int", None, endpoints=frozenset({"chat"}),
          range=Range(0, MAX_LOGPROBS), nullable=True, doc="needs logprobs: true"),
    Field("prefix_leader", "int", 0, endpoints=NONE, wire=16,
          doc="set by the server: the uid whose prefill choice i > 0 of n waits for"),
    Field("response_format", "object", None, wire=17),
    Field("priority", "int", 0, range=Range(*PRIORITY_RANGE), range_in_type=True,
          null_is_default=False, wire=18),
    Field("n", "int", 1, range=Range(1, MAX_N)),
    Field("stream", "bool", False, endpoints=HTTP),
    Field("stream_options", "stream_options", endpoints=HTTP),
    Field("tools", "array", endpoints=frozenset({"chat"}), default_only=_TOOLS_OFF),
    Field("tool_choice", "tool_choice", endpoints=frozenset({"chat"}),
          default_only=(None, "none")),
    Field("parallel_tool_calls", "bool", endpoints=frozenset({"chat"}),
          ignored=frozenset({"completions"})),
    Field("chat_template_kwargs", "object", endpoints=frozenset({"chat"})),
    Field("user", "string", endpoints=NONE, ignored=HTTP),
    Field("store", "bool", endpoints=NONE, ignored=HTTP),
    Field("metadata", "object", endpoints=NONE, ignored=HTTP),
    Field("service_tier", "string", endpoints=NONE, ignored=HTTP),
    Field("echo", "bool", endpoints=NONE, default_only=(False, None)),
    Field("best_of", "int", endpoints=NONE, default_only=(1, None)),
    Field("suffix", "string", endpoints=NONE, default_only=(None,)),
    Field("functions", "array", endpoints=NONE, default_only=(None,)),
    Field("function_call", "tool_choice", endpoints=NONE, default_only=(None, "none")),
)  # fmt: skip

WIRE_FIELDS: tuple[str, ...] = tuple(
    f.name for f in sorted((f for f in FIELDS if f.wire is not None), key=lambda f: f.wire or 0)
)
assert [f.wire for f in FIELDS if f.wire is not None] == list(range(len(WIRE_FIELDS)))


def fields_for(endpoint: str, ignored: bool = False) -> dict[str, Field]:
    """The fields an endpoint reads (and, with `ignored`, those it accepts and ignores)."""
    out: dict[str, Field] = {}
    for f in FIELDS:
        if endpoint in f.endpoints or (ignored and endpoint in f.ignored):
            assert f.name not in out, (endpoint, f.name)
            out[f.name] = f
    return out


def accepted(endpoint: str) -> set[str]:
    """The names an endpoint reads."""
    return set(fields_for(endpoint))


def ignored(endpoint: str) -> set[str]:
    """The names an endpoint accepts and ignores."""
    return {f.name for f in FIELDS if endpoint in f.ignored}


def default_only(endpoint: str) -> dict[str, tuple]:
    """The names an endpoint accepts only with their default values, and those values."""
    return {
        f.name: f.default_only for f in FIELDS if f.default_only and endpoint not in f.endpoints
    }


# `SamplingParams`' defaults (the offline ones)
DEFAULTS: Mapping[str, Any] = {name: f.default for name, f in fields_for("offline").items()}
# the wire fields that are `SamplingParams`' too (all but skip_special_tokens, prefix_leader)
SAMPLING_WIRE_FIELDS: tuple[str, ...] = tuple(n for n in WIRE_FIELDS if n in DEFAULTS)
