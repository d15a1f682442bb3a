"""Fifty varied JSON schemas for constrained decoding tests (issue 38): enums, const, nested
objects, arrays, integers and numbers with bounds, anyOf, nullable fields, patterns, lengths.

Every string, array and number is bounded (maxLength, maxItems, a pattern or a range), so even
a random-weight model reaches the end of each schema in a few dozen tokens.
"""

from __future__ import annotations

from typing import Any


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


S8 = {"type": "string", "maxLength": 8}
I99 = {"type": "integer", "minimum": 0, "maximum": 99}
BOOL = {"type": "boolean"}

SCHEMAS: tuple[dict[str, Any], ...] = (
    # scalars at the top
    {"type": "boolean"},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "string", "maxLength": 6},
    {"enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    {"type": "null"},
    {"type": "string", "pattern": "^[a-z]{2,5}$"},
    {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
    {"enum": [1, 2, 3, "many", None, True]},
    {"type": "string", "minLength": 2, "maxLength": 4},
    # flat objects
    _obj({"name": S8, "age": I99}),
    _obj({"ok": BOOL}),
    _obj({"color": {"enum": ["red", "green", "blue"]}, "shade": {"enum": ["light", "dark"]}}),
    _obj({"id": {"type": "integer", "minimum": 1, "maximum": 9}, "label": {"const": "item"}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    _obj({"answer": {"type": "string", "pattern": "^[A-D]$"}}),
    _obj(
        {"temp": {"type": "integer", "minimum": -40, "maximum": 50}, "unit": {"enum": ["C", "F"]}}
    ),
    _obj({"x": I99, "y": I99, "z": I99}),
    _obj({"name": S8, "nick": S8}, required=["name"]),
    _obj({"a": BOOL, "b": BOOL, "c": BOOL, "d": BOOL}),
    # nullable and anyOf
    _obj({"x": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}}),
    _obj({"v": {"anyOf": [S8, I99, BOOL]}}),
    _obj({"maybe": {"type": ["string", "null"], "maxLength": 5}}),
    {
        "anyOf": [
            _obj(
                {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}}
            ),
            _obj({"kind": {"const": "dog"}, "good": BOOL}),
        ]
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"enum": ["none", "all"]}]},
    _obj({"shape": {"anyOf": [_obj({"r": I99}), _obj({"w": I99, "h": I99})]}}),
    # arrays
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
    {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    _obj({"tags": {"type": "array", "items": S8, "maxItems": 3}}),
    _obj({"points": {"type": "array", "maxItems": 2, "items": _obj({"x": I99, "y": I99})}}),
    _obj(
        {
            "matrix": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 2,
                },
            }
        }
    ),
    {"type": "array", "items": BOOL, "minItems": 1, "maxItems": 1},
    _obj(
        {
            "first": {"type": "array", "items": I99, "minItems": 1, "maxItems": 2},
            "rest": {"type": "array", "items": S8, "maxItems": 1},
        }
    ),
    {"type": "array", "prefixItems": [I99, S8], "items": False, "minItems": 2},
    # nested objects
    _obj(
        {"city": _obj({"name": S8, "pop": {"type": "integer", "minimum": 0, "maximum": 99999999}})}
    ),
    _obj(
        {
            "user": _obj(
                {"name": S8, "address": _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}
            )
        }
    ),
    _obj({"meta": _obj({"version": {"const": 1}, "flags": _obj({"beta": BOOL})})}),
    _obj(
        {
            "order": _obj(
                {
                    "qty": {"type": "integer", "minimum": 1, "maximum": 5},
                    "size": {"enum": ["S", "M", "L"]},
                }
            ),
            "paid": BOOL,
        }
    ),
    _obj({"a": _obj({"b": _obj({"c": _obj({"d": BOOL})})})}),
    _obj({"range": _obj({"lo": I99, "hi": I99}), "step": {"enum": [1, 2, 5]}}),
    # numbers
    _obj({"score": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}}),
    _obj({"p": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    _obj({"n": {"type": "integer", "minimum": 100, "maximum": 200}}),
    _obj({"neg": {"type": "integer", "minimum": -99, "maximum": -1}}),
    _obj({"ratio": {"enum": [0.5, 1.5, 2.5]}}),
    # refs, formats and mixed
    {
        "$defs": {"pt": _obj({"x": I99, "y": I99})},
        **_obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}),
    },
    _obj({"when": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    _obj({"status": {"enum": ["ok", "error"]}, "detail": S8, "retry": BOOL}, ["status"]),
    _obj({"email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"}}),
    _obj(
        {
            "call": {"const": "get_weather"},
            "args": _obj({"city": {"enum": ["Paris", "Rome"]}, "days": I99}),
        }
    ),
)
assert len(SCHEMAS) == 50


# two OpenAI tools (bounded arguments) the tool-calling tests offer, offline and on the server
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -99, "maximum": 99},
        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

# properties in an order that is not alphabetical (issue 60): the output must keep it
UNSORTED_ORDER = ["zebra", "apple", "mango"]
UNSORTED = _obj({"zebra": {"type": "integer", "minimum": 0, "maximum": 9},
                 "apple": {"type": "integer", "minimum": 0, "maximum": 9}, "mango": BOOL})  # fmt: skip
UNSORTED_TOOL = {"type": "function", "function": {
    "name": "pick", "description": "Pick three values.", "parameters": UNSORTED}}  # fmt: skip
