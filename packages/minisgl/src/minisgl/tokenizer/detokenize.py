"""Incremental, batched detokenization with stop strings.

Text is only released once it is valid UTF-8 (a token ending inside a multi-byte character
waits for the next one), and text that could be the start of a stop string is held back until
it is known not to be one, so the streamed pieces always concatenate to the final text.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class DecodeState:
    stops: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    prompt_tokens: int = 0
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # decoded text so far (stop string cut away once hit)
    sent: int = 0  # characters of `text` already released
    unsent_tokens: int = 0
    finished: str | None = None
    prompt_sent: bool = False

    @property
    def max_stop(self) -> int:
        return max((len(s) for s in self.stops), default=0)


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def plain_decoder(tokenizer):
    """The `tokenizers.Tokenizer` behind a fast HF tokenizer when decoding with it alone gives
    the HF call's text (no clean-up of tokenization spaces configured); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode_batch"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.backend = plain_decoder(tokenizer)

    def decode(self, seqs: list[list[int]], skips: list[bool]) -> list[str]:
        """Each sequence's text (`skips`: its skip_special_tokens), one batched call per flag
        value: the Rust backend's `decode_batch` directly where it gives the HF call's text
        (transformers' per-sequence wrapper cost more than the decoding under load)."""
        out: list[str] = [""] * len(seqs)
        for flag in (True, False):
            idx = [i for i, f in enumerate(skips) if f is flag]
            if not idx:
                continue
            part = [seqs[i] for i in idx]
            if self.backend is not None:
                texts = self.backend.decode_batch(part, skip_special_tokens=flag)
            else:
                texts = self.tokenizer.batch_decode(part, skip_special_tokens=flag)
            for i, t in zip(idx, texts, strict=True):
                out[i] = t
        return out

    def update(
        self, items: list[tuple[DecodeState, list[int], str | None]]
    ) -> list[tuple[DecodeState, str, bool]]:
        """items: (state, new token ids, scheduler finish reason or None).

        Returns (state, released text, stop_hit) per item; `state.finished` is set when the
        request is over (by the scheduler, or by a stop string: stop_hit).
        """
        pre, full = [], []
        for st, new_ids, _ in items:
            st.ids.extend(new_ids)
            st.unsent_tokens += len(new_ids)
            pre.append(st.ids[st.prefix_offset : st.read_offset])
            full.append(st.ids[st.prefix_offset :])
        skips = [bool(st.skip_special_tokens) for st, _, _ in items]
        texts = self.decode(pre + full, skips + skips)
        n = len(items)
        out = []
        for i, (st, _, reason) in enumerate(items):
            prefix_text, new_text = texts[i], texts[n + i]
            done = reason is not None
            if len(new_text) > len(prefix_text) and (done or not new_text.endswith("\ufffd")):
                old = len(st.text)
                st.text += new_text[len(prefix_text) :]
                st.prefix_offset = st.read_offset
                st.read_offset = len(st.ids)
                stop_hit = False
                if st.stops:
                    start = max(0, old - st.max_stop + 1)
                    cuts = [p for p in (st.text.find(s, start) for s in st.stops) if p >= 0]
                    if cuts:
                        st.text = st.text[: min(cuts)]
                        stop_hit = True
                if stop_hit:
                    st.finished = "stop"
                    out.append((st, self._release(st, st.text), True))
                    continue
            if done:
                st.finished = reason
                out.append((st, self._release(st, st.text), False))
                continue
            hold = _held_back(st.text, st.stops) if st.stops else 0
            out.append((st, self._release(st, st.text[: len(st.text) - hold]), False))
        return out

    @staticmethod
    def _release(st: DecodeState, upto: str) -> str:
        piece = upto[st.sent :]
        st.sent = max(st.sent, len(upto))
        return piece
