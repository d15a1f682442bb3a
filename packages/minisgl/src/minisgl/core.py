"""User-facing request types: sampling parameters and finish reasons."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from minisgl import sampling_fields as table
from minisgl.sampling_fields import (  # noqa: F401  (re-exported)
    DEFAULTS,
    PRIORITY_RANGE,
    SEED_RANGE,
    as_items,
    type_name,
)

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's threshold)


def choice_seed(seed: int | None, i: int) -> int | None:
    """The seed of choice i of an n > 1 request: `seed + i` modulo 2**63 (as vLLM does), None
    for an unseeded one. The server's `n` and `LLM.generate` both draw their choices so."""
    return None if seed is None else (seed + i) % SEED_RANGE


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (OpenAI / vLLM semantics). Their types, ranges and
    defaults are the table of request parameters (`sampling_fields.FIELDS`), which the server
    reads too: a value refused here is refused there with the same message.

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

    temperature: float = DEFAULTS["temperature"]
    top_k: int = DEFAULTS["top_k"]
    top_p: float = DEFAULTS["top_p"]
    max_tokens: int = DEFAULTS["max_tokens"]
    ignore_eos: bool = DEFAULTS["ignore_eos"]
    seed: int | None = DEFAULTS["seed"]
    stop: str | list[str] | None = DEFAULTS["stop"]
    stop_token_ids: list[int] | tuple[int, ...] | None = DEFAULTS["stop_token_ids"]
    presence_penalty: float = DEFAULTS["presence_penalty"]
    frequency_penalty: float = DEFAULTS["frequency_penalty"]
    repetition_penalty: float = DEFAULTS["repetition_penalty"]
    min_p: float = DEFAULTS["min_p"]
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = DEFAULTS["logit_bias"]
    min_tokens: int = DEFAULTS["min_tokens"]
    logprobs: int | None = DEFAULTS["logprobs"]
    n: int = DEFAULTS["n"]
    response_format: Any = DEFAULTS["response_format"]  # a mapping, or a ResponseFormat
    priority: int = DEFAULTS["priority"]  # the waiting queue's order (lower first)
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    # the argmax of the raw logits is the whole choice (no bias, penalty, logprobs or grammar);
    # min_tokens aside, which depends on the request's progress: read once a step per row
    argmax_only: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # every field is checked by the one table of request parameters (`sampling_fields`):
        # a bad value is a ValueError naming it, the message the server answers 400 with
        for name, f in table.fields_for("offline").items():
            v = getattr(self, name)
            if v is None and not f.nullable and f.kind not in ("int", "number", "bool"):
                continue  # absent (stop, stop_token_ids, logit_bias, response_format)
            v = f.check(v)
            if name == "stop":
                object.__setattr__(self, "stop_strings", v)  # `stop` stays as it was given
            else:
                object.__setattr__(self, name, v)
        if self.stop is None:
            object.__setattr__(self, "stop_strings", ())
        object.__setattr__(self, "logit_bias", self.logit_bias or ())
        table.check_min_tokens(self.min_tokens, self.max_tokens)
        if self.response_format is not None:
            from minisgl.structured import ResponseFormat

            fmt = ResponseFormat.parse(self.response_format)
            if fmt is not None and self.ignore_eos:
                raise table.ParamError(table.RESPONSE_FORMAT_WITH_IGNORE_EOS, "response_format")
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
