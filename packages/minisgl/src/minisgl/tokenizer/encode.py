"""Prompt -> token ids, in the API server (python backend; the Rust service tokenizes itself).

`PromptEncoder.ids(kind, prompt)` renders a chat through the model's template (no BOS added,
the template has it) or encodes a text (with BOS), through the `tokenizers` backend directly
when it is plain. A prompt longer than `OFF_LOOP_CHARS` is better encoded off the event loop
(`encode_off_loop`): the backend's batched encode releases the GIL.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np

OFF_LOOP_CHARS = 16384  # ~4k tokens, ~8 ms of encoding on the 2-core machine


class PromptError(ValueError):
    """The prompt cannot become token ids (a chat the template cannot render)."""


def plain_backend(tok):
    """The `tokenizers.Tokenizer` behind a fast HF tokenizer when encoding with it alone gives
    the HF call's ids (no truncation or padding configured on it, which the HF call would
    switch off); else None."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    return backend


def max_token_chars(tok) -> int:
    """An upper bound on the characters one token covers (byte-level tokens: one character per
    byte), so a text longer than context x this can be refused before tokenizing it."""
    names = tok.convert_ids_to_tokens(list(range(len(tok))))
    return max((len(t) for t in names if t is not None), default=1)


class PromptEncoder:
    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.backend = plain_backend(tokenizer)

    @property
    def threadsafe(self) -> bool:
        """Whether `ids` may run in a thread beside the loop's calls: the plain backend's
        encode does (the HF call re-configures the backend's truncation on each call)."""
        return self.backend is not None

    def warm_up(self) -> float:
        """Each path's first call, outside any request: the chat template's compilation and an
        encode of both special-token settings (on SmolLM2's tokenizer the first template render
        alone took 5.5 ms, later ones 0.04). Returns its wall time in ms."""
        t0 = time.perf_counter()
        text = "Hello"
        with contextlib.suppress(PromptError):  # no chat template: chats get a 400 later
            text = self.text("chat", [{"role": "user", "content": text}])
        for flag in (True, False):
            self.encode(text, flag)
        return (time.perf_counter() - t0) * 1e3

    def text(self, kind: str, prompt: Any) -> str:
        """The text a text or chat prompt is encoded from."""
        if kind != "chat":
            return prompt
        try:
            return self.tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        except Exception as e:
            raise PromptError(f"cannot render the chat: {e}") from None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`: the Rust backend directly when it is plain (~25% faster than
        the HF call on random-token prompts: no offsets, no BatchEncoding; its batched call
        releases the GIL)."""
        if self.backend is not None:
            return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[
                0
            ].ids
        return self.tok([text], add_special_tokens=add_special_tokens)["input_ids"][0]

    def ids(self, kind: str, prompt: Any) -> np.ndarray:
        """A prompt's token ids (int32): given ids as they are, a chat rendered (no BOS), a
        text encoded with BOS."""
        if kind == "ids":
            return np.asarray(prompt, dtype=np.int32)
        text = self.text(kind, prompt)
        return np.asarray(self.encode(text, kind != "chat"), dtype=np.int32)


def prompt_chars(kind: str, prompt: Any) -> int:
    """The characters a prompt's encoding reads (what `OFF_LOOP_CHARS` is compared with)."""
    if kind == "text":
        return len(prompt)
    if kind == "chat":
        return sum(len(str(m.get("content") or "")) for m in prompt)
    return 0
