"""Prompt -> token ids, in the API server (python backend; the Rust service tokenizes itself).

`PromptEncoder.ids(kind, prompt)` renders a chat through the model's template (no BOS added,
the template has it) or encodes a text (with BOS), through the `tokenizers` backend directly
when it is plain. `EncodeThread` encodes beside an event loop: the backend's batched encode
releases the GIL, so the loop parses the next requests while the last ones are encoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from typing import Any

import numpy as np


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


_Item = tuple[str, bool, asyncio.Future, asyncio.AbstractEventLoop]


class EncodeThread:
    """Encodes texts for coroutines, in a thread: each turn takes every text queued so far into
    one `encode_batch_fast` call per special-token setting (outside the GIL: the loop runs
    meanwhile) and hands the ids back in one loop callback. A burst of requests is encoded as
    the loop parses it, on the other core, not after each request on the loop's own."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="minisgl-encode", daemon=True)
        self._thread.start()

    def encode(self, text: str, add_special_tokens: bool) -> asyncio.Future:
        """A future of `text`'s ids (int32), on the running loop."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.put((text, add_special_tokens, fut, loop))
        return fut

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self._queue.get_nowait())
            items = [b for b in batch if b is not None]
            if items:
                self._encode(items)
            if len(items) < len(batch):
                return

    def _encode(self, items: list[_Item]) -> None:
        done: dict[asyncio.AbstractEventLoop, list] = {}
        for flag in (True, False):
            part = [it for it in items if it[1] is flag]
            if not part:
                continue
            try:
                encs = self.backend.encode_batch_fast(
                    [it[0] for it in part], add_special_tokens=flag
                )
                out = [
                    (it[2], np.asarray(e.ids, dtype=np.int32), None) for it, e in zip(part, encs)
                ]
            except Exception as e:  # a tokenizer failure fails these requests, not the thread
                out = [(it[2], None, e) for it in part]
            for it, row in zip(part, out, strict=True):
                done.setdefault(it[3], []).append(row)
        for loop, rows in done.items():
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(_deliver, rows)


def _deliver(rows: list) -> None:
    for fut, ids, err in rows:
        if fut.done():  # the request went away meanwhile
            continue
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(ids)
