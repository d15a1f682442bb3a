"""User-facing request types: sampling parameters and finish reasons."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (OpenAI / vLLM semantics).

    temperature 0 (or top_k 1) means greedy. top_k <= 0 means no top-k filter.
    """

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise TypeError(f"max_tokens must be an int, got {type(self.max_tokens).__name__}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int):
            raise TypeError(f"top_k must be an int, got {type(self.top_k).__name__}")
        stop = self.stop
        if stop is None:
            strings: tuple[str, ...] = ()
        elif isinstance(stop, str):
            strings = (stop,)
        else:
            strings = tuple(stop)
        if any(not isinstance(s, str) or s == "" for s in strings):
            raise ValueError("stop strings must be non-empty strings")
        object.__setattr__(self, "stop_strings", strings)
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
