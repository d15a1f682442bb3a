"""Request schemas for `/openapi.json`, generated from the table of request parameters
(`minisgl.sampling_fields`): every field an endpoint reads or ignores, with its type, range and
bounds as the validator checks them.

The handlers validate raw JSON themselves (OpenAI-style 400s, never FastAPI's 422), so these
schemas only document what `parse_chat` / `parse_completion` accept.
"""

from __future__ import annotations

from typing import Any

from minisgl.sampling_fields import INT64, LOGIT_BIAS_RANGE, Field, Range, fields_for

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "null"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                    },
                },
            ]
        },
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
    },
}
_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": INT64 - 1}
# the kinds whose schema is a fixed shape (the others follow from the field's range)
_SHAPES: dict[str, dict[str, Any]] = {
    "bool": {"type": "boolean"},
    "string": {"type": "string"},
    "object": {"type": "object"},
    "array": {"type": "array", "items": {"type": "object"}},
    "token_ids": {"type": "array", "items": _TOKEN_ID},
    "tool_choice": {"anyOf": [{"type": "string"}, {"type": "object"}]},
    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "prompt": {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
        ]
    },
    "stream_options": {
        "type": "object",
        "properties": {
            "include_usage": {"type": "boolean"},
            "continuous_usage_stats": {"type": "boolean"},
        },
        "additionalProperties": False,
    },
}


def _number(r: Range) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "number"}
    if r.lo is not None:
        s["exclusiveMinimum" if r.lo_open else "minimum"] = r.lo
    if r.hi is not None:
        s["exclusiveMaximum" if r.hi_open else "maximum"] = r.hi
    return s


def _integer(f: Field, max_seq_len: int) -> dict[str, Any]:
    r = f.range or Range()
    s: dict[str, Any] = {"type": "integer"}
    if r.lo is not None:
        s["minimum"] = int(r.lo) + (1 if r.lo_open else 0)
    if f.context_bound:
        s["maximum"] = max_seq_len
    elif r.hi is not None:
        s["maximum"] = int(r.hi) - (1 if r.hi_open else 0)
    else:
        s["maximum"] = INT64 - 1
    return s


def field_schema(f: Field, max_seq_len: int) -> dict[str, Any]:
    """One field's JSON schema (its bounds the table's; `context_bound`: the context), with
    the table's note as its description."""
    s = _shape(f, max_seq_len)
    return {**s, "description": f.doc} if f.doc else s


def _shape(f: Field, max_seq_len: int) -> dict[str, Any]:
    if f.kind == "number":
        return _number(f.range or Range())
    if f.kind == "int":
        return _integer(f, max_seq_len)
    if f.kind == "stop":
        string = {"type": "string", "minLength": 1}
        many = {"type": "array", "maxItems": f.max_items, "items": string}
        return {"anyOf": [string, many]}
    if f.kind == "logit_bias":
        return {
            "type": "object",
            "maxProperties": f.max_items,
            "propertyNames": {"pattern": "^[0-9]{1,10}$"},
            "additionalProperties": _number(Range(*LOGIT_BIAS_RANGE)),
        }
    return dict(_SHAPES[f.kind])


def request_bodies(max_seq_len: int) -> dict[str, dict]:
    """operation -> `openapi_extra` with its requestBody."""

    def body(endpoint: str) -> dict:
        fields = fields_for(endpoint, ignored=True)
        schema = {
            "type": "object",
            "required": [name for name, f in fields.items() if f.required],
            "properties": {name: field_schema(f, max_seq_len) for name, f in fields.items()},
        }
        return {
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": schema}},
            },
            "responses": {"400": {"description": "OpenAI-style error body"}},
        }

    return {"chat": body("chat"), "completions": body("completions")}
