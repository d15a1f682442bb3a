"""Request schemas for `/openapi.json`, written from the validator's own bounds (protocol.py).

The handlers validate raw JSON themselves (OpenAI-style 400s, never FastAPI's 422), so these
schemas only document what `parse_chat` / `parse_completion` accept.
"""

from __future__ import annotations

from typing import Any

from minisgl.server.protocol import INT64, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N


def _num(lo: float, hi: float, exclusive_lo: bool = False) -> dict:
    s: dict[str, Any] = {"type": "number", "maximum": hi}
    s["exclusiveMinimum" if exclusive_lo else "minimum"] = lo
    return s


def _common(max_seq_len: int) -> dict[str, Any]:
    ints = {"type": "integer", "minimum": 0, "maximum": INT64 - 1}
    return {
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": max_seq_len},
        "temperature": _num(0.0, 2.0),
        "top_p": _num(0.0, 1.0, exclusive_lo=True),
        "top_k": {"type": "integer", "minimum": -1, "maximum": INT64 - 1},
        "min_p": _num(0.0, 1.0),
        "presence_penalty": _num(-2.0, 2.0),
        "frequency_penalty": _num(-2.0, 2.0),
        "repetition_penalty": _num(0.0, 2.0, exclusive_lo=True),
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": max_seq_len},
        "logit_bias": {
            "type": "object",
            "maxProperties": MAX_LOGIT_BIAS,
            "propertyNames": {"pattern": "^[0-9]{1,10}$"},
            "additionalProperties": _num(-100.0, 100.0),
        },
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
        "seed": ints,
        "stop": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "maxItems": 16, "items": {"type": "string", "minLength": 1}},
            ]
        },
        "stop_token_ids": {"type": "array", "items": ints},
        "ignore_eos": {"type": "boolean"},
        "skip_special_tokens": {"type": "boolean"},
        "stream": {"type": "boolean"},
        "stream_options": {
            "type": "object",
            "properties": {
                "include_usage": {"type": "boolean"},
                "continuous_usage_stats": {"type": "boolean"},
            },
            "additionalProperties": False,
        },
        "user": {"type": "string"},
    }


def request_bodies(max_seq_len: int) -> dict[str, dict]:
    """operation -> `openapi_extra` with its requestBody."""
    message = {
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
    chat = {
        **_common(max_seq_len),
        "messages": {"type": "array", "minItems": 1, "items": message},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": max_seq_len},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
    }
    completion = {
        **_common(max_seq_len),
        "prompt": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
            ]
        },
        "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
    }

    def body(props: dict, required: list[str]) -> dict:
        schema = {"type": "object", "required": required, "properties": props}
        return {
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": schema}},
            },
            "responses": {"400": {"description": "OpenAI-style error body"}},
        }

    return {
        "chat": body(chat, ["messages"]),
        "completions": body(completion, ["prompt"]),
    }
