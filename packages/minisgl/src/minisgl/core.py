"""User-facing request types: sampling parameters and finish reasons."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from numbers import Integral
from typing import Any

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's threshold)
SEED_RANGE = 2**63  # seeds are in [0, 2**63)
# the server's bounds, which `SamplingParams` holds offline too (one request, one verdict)
MAX_TEMPERATURE = 2.0
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 1024
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # a request's priority (lower first: vLLM's sign)


def choice_seed(seed: int | None, i: int) -> int | None:
    """The seed of choice i of an n > 1 request: `seed + i` modulo 2**63 (as vLLM does), None
    for an unseeded one. The server's `n` and `LLM.generate` both draw their choices so."""
    return None if seed is None else (seed + i) % SEED_RANGE


def _is_int(v: Any, kind: type = int) -> bool:
    return isinstance(v, kind) and not isinstance(v, bool)


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


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (OpenAI / vLLM semantics).

    temperature 0 (below 1e-5, or top_k 1) means greedy. top_k <= 0 means no top-k filter.
    min_p 0 is off. presence / frequency penalties (OpenAI, on generated tokens) are in
    [-2, 2]; repetition_penalty (HF / vLLM, on prompt and generated tokens) in (0, 2], 1 is off.
    logit_bias maps token ids to a bias in [-100, 100] added to the logits. min_tokens: the
    stop / EOS tokens are banned until that many tokens were generated. logprobs: None for
    none, k >= 0 for the sampled token's logprob plus the k most likely (at most 20).
    n: the number of samples `LLM.generate` draws per prompt (parallel sampling).
    response_format: OpenAI's `{"type": "json_object"}` or `{"type": "json_schema",
    "json_schema": {"schema": {...}}}` (`{"type": "text"}` is none): decoding is constrained
    by its grammar (`structured.py`); stored as a `ResponseFormat`.
    """

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    n: int = 1
    response_format: Any = None  # an OpenAI response_format mapping, or a ResponseFormat
    priority: int = 0  # the waiting queue's order under priority scheduling (lower first)
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    # the argmax of the raw logits is the whole choice (no bias, penalty, logprobs or grammar);
    # min_tokens aside, which depends on the request's progress: read once a step per row
    argmax_only: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # every bad value is a ValueError naming its field, a wrong type included
        for name in ("max_tokens", "top_k", "min_tokens", "n"):
            v = getattr(self, name)
            if not _is_int(v):
                raise ValueError(f"{name} must be an int, got {type(v).__name__}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got {type(self.seed).__name__}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        lo, hi = PRIORITY_RANGE
        if not _is_int(self.priority) or not lo <= self.priority <= hi:
            raise ValueError(f"priority must be an int in [{lo}, {hi}], got {self.priority!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):  # fmt: skip
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be >= 0 and <= {MAX_TEMPERATURE}, got {self.temperature}"
            )
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < SEED_RANGE:
            raise ValueError(f"seed must be None or in [0, 2**63), got {self.seed}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        lp = self.logprobs
        if lp is not None and (
            not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= 20
        ):
            raise ValueError(f"logprobs must be None or an int in [0, 20], got {lp!r}")
        bias = self.logit_bias or ()
        items = tuple(bias.items()) if isinstance(bias, Mapping) else as_items(bias)
        if items is None or any(not isinstance(i, tuple | list) or len(i) != 2 for i in items):
            raise ValueError(
                "logit_bias must be a mapping of token ids to biases, got "
                f"{type_name(bias, tuple | list)}"
            )
        if len(items) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, got {len(items)}")
        pairs = []
        for t, v in items:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {t!r}")
            if not isinstance(v, int | float) or isinstance(v, bool) or not -100 <= v <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r}")
            pairs.append((t, float(v)))
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs)))
        stop = self.stop
        strings = (stop,) if isinstance(stop, str) else () if stop is None else as_items(stop)
        if strings is None or any(not isinstance(s, str) for s in strings):
            raise ValueError(
                f"stop must be a string or a list of strings, got {type_name(stop, str)}"
            )
        if any(s == "" for s in strings):
            raise ValueError("stop strings must be non-empty strings")
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(strings)}")
        object.__setattr__(self, "stop_strings", strings)
        if self.stop_token_ids is not None:
            ids = as_items(self.stop_token_ids)
            if ids is None or not all(_is_int(t, Integral) for t in ids):  # numpy ints too
                kind = type_name(self.stop_token_ids, Integral)
                raise ValueError(f"stop_token_ids must be a list of token ids, got {kind}")
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        if self.response_format is not None:
            from minisgl.structured import ResponseFormat

            fmt = ResponseFormat.parse(self.response_format)
            if fmt is not None and self.ignore_eos:
                raise ValueError(
                    "response_format cannot combine with ignore_eos: a constrained output ends "
                    "with EOS once the grammar is complete"
                )
            object.__setattr__(self, "response_format", fmt)
        plain = not (self.logit_bias or self.has_penalties or self.logprobs is not None)
        argmax_only = self.is_greedy and plain and self.response_format is None
        object.__setattr__(self, "argmax_only", argmax_only)

    def for_choice(self, i: int) -> SamplingParams:
        """These parameters for choice i of the `n` (`choice_seed`: seed + i)."""
        if i == 0 or self.seed is None:
            return self
        return replace(self, seed=choice_seed(self.seed, i))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def needs_history(self) -> bool:
        """The sampler reads the request's committed outputs (penalties, a grammar)."""
        return self.has_penalties or self.response_format is not None

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
