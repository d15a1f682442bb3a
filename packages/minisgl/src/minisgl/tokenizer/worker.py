"""Tokenizer / detokenizer worker process.

Requests (from the API server) are tokenized in batched waves of 1, 2, 4, ... prompts
(`Backlog`), the inbox read between waves. Tokens (from the scheduler) are detokenized
incrementally, in batches, before any tokenization, with stop strings checked here: a hit tells
the scheduler to finish the request. Worker i serves the requests with uid % num_tokenizer == i.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zmq

from minisgl import ipc
from minisgl.ipc import replica_of
from minisgl.message.schema import (
    AbortReq,
    AddReq,
    Codec,
    DetokOut,
    FinishReq,
    Ready,
    Reject,
    Shutdown,
    TokenizeReq,
    TokenOut,
)
from minisgl.tokenizer.detokenize import DecodeState, Detokenizer
from minisgl.tokenizer.load import load_tokenizer
from minisgl.utils import trace


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


class TokenizerWorker:
    def __init__(self, tokenizer, codec: Codec) -> None:
        self.tok = tokenizer
        self.codec = codec
        self.backend = plain_backend(tokenizer)
        self.detok = Detokenizer(tokenizer)
        self.states: dict[int, DecodeState] = {}
        self.pending_lp: dict[int, list] = {}  # uid -> [token id, lp, top ids, top lps] unsent

    def warm_up(self) -> float:
        """Each path's first call, outside any request: the chat template's compilation, a
        batched encode of both special-token settings and a streamed decode (on SmolLM2's
        tokenizer the first template render alone took 5.5 ms, later ones 0.1). Leaves no
        state. Returns its wall time in ms."""
        t0 = time.perf_counter()
        text = "Hello"
        with contextlib.suppress(Exception):  # no chat template: chat requests get a 400 later
            text = self.tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        ids: list[int] = []
        for flag in (True, False):
            ids = self.tok([text], add_special_tokens=flag)["input_ids"][0]
        state = DecodeState()
        for i, t in enumerate(ids[:8]):
            self.detok.update([(state, [t], "length" if i == min(len(ids), 8) - 1 else None)])
        return (time.perf_counter() - t0) * 1e3

    # ------------------------------------------------------------------ tokenize
    def tokenize(self, reqs: list[TokenizeReq]) -> tuple[list[AddReq], list[Reject]]:
        adds: list[AddReq] = []
        rejects: list[Reject] = []
        texts: list[str] = []
        text_reqs: list[tuple[TokenizeReq, bool]] = []  # (req, add_special_tokens)
        for r in reqs:
            try:
                if r.kind == "ids":
                    adds.append(AddReq(r.uid, np.asarray(r.prompt, dtype=np.int32), r.params))
                elif r.kind == "chat":
                    rendered = self.tok.apply_chat_template(
                        r.prompt, add_generation_prompt=True, tokenize=False
                    )
                    texts.append(rendered)
                    text_reqs.append((r, False))
                else:
                    texts.append(r.prompt)
                    text_reqs.append((r, True))
            except Exception as e:
                rejects.append(Reject(r.uid, f"cannot tokenize the prompt: {e}", 400))
        if texts:
            # one batched call per add_special_tokens value
            for flag in (True, False):
                idx = [i for i, (_, f) in enumerate(text_reqs) if f is flag]
                if not idx:
                    continue
                enc = self.encode([texts[i] for i in idx], flag)
                for i, ids in zip(idx, enc, strict=True):
                    r = text_reqs[i][0]
                    adds.append(AddReq(r.uid, np.asarray(ids, dtype=np.int32), r.params))
        for a in adds:
            p = a.params
            self.states[a.uid] = DecodeState(
                stops=tuple(p.stop or ()),
                skip_special_tokens=p.skip_special_tokens,
                prompt_tokens=len(a.input_ids),
            )
        return adds, rejects

    def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Token ids of `texts`, one batched call: the Rust backend directly when it is plain
        (~25% faster than the HF call on random-token prompts: no offsets, no BatchEncoding)."""
        if self.backend is not None:
            encs = self.backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
            return [e.ids for e in encs]
        return self.tok(texts, add_special_tokens=add_special_tokens)["input_ids"]

    # ------------------------------------------------------------------ detokenize
    def detokenize(self, outs: list[TokenOut]) -> tuple[DetokOut | None, list[FinishReq]]:
        merged: dict[int, list] = {}  # uid -> [state, new ids, reason]
        for o in outs:
            lps = o.logprobs or [None] * len(o.finished)
            for uid, tok, reason, lp in zip(o.uids.tolist(), o.tokens.tolist(), o.finished, lps):
                st = self.states.get(uid)
                if st is None or st.finished is not None:
                    continue  # aborted or already stopped: late tokens are dropped
                m = merged.get(uid)
                if m is None:
                    merged[uid] = m = [st, [], None]
                if m[2] is None:
                    m[1].append(tok)
                    m[2] = reason
                    if lp is not None:
                        self.pending_lp.setdefault(uid, []).append([tok, *lp])
        if not merged:
            return None, []
        uids = list(merged)
        results = self.detok.update([tuple(merged[u]) for u in uids])
        out = DetokOut([], [], [], [], [])
        finishes: list[FinishReq] = []
        for uid, (st, text, stop_hit) in zip(uids, results, strict=True):
            if stop_hit:
                finishes.append(FinishReq(uid, "stop"))
            if not text and st.finished is None:
                continue  # nothing printable yet (partial UTF-8 or held for a stop string)
            out.uids.append(uid)
            out.texts.append(text)
            out.counts.append(st.unsent_tokens)
            out.finished.append(st.finished)
            out.prompt_tokens.append(st.prompt_tokens)
            out.logprobs.append(self.pending_lp.pop(uid, None))
            st.unsent_tokens = 0
            if st.finished is not None:
                del self.states[uid]
        if any(x is not None for x in out.logprobs):
            self._name_tokens(out.logprobs)
        else:
            out.logprobs = []
        return (out if out.uids else None), finishes

    def forget(self, uid: int) -> None:
        """Drop a request's state (aborted, or rejected by the scheduler)."""
        self.states.pop(uid, None)
        self.pending_lp.pop(uid, None)

    def _name_tokens(self, entries: list) -> None:
        """[token id, lp, top ids, top lps] -> [token, lp, [[token, lp], ...]] (one decode call)."""
        ids = sorted({t for e in entries if e for r in e for t in (r[0], *r[2])})
        names = dict(zip(ids, self.tok.batch_decode([[t] for t in ids]), strict=True))
        for i, e in enumerate(entries):
            if e:
                entries[i] = [
                    [names[t], lp, [[names[x], v] for x, v in zip(tids, tlps, strict=True)]]
                    for t, lp, tids, tlps in e
                ]


MAX_WAVE = 4096  # prompts in one batched call at most


class Backlog:
    """Prompts waiting to be tokenized, taken in waves of 1, 2, 4, ...: the first prompt of a
    burst reaches the engine after one prompt's encoding (its prefill can start while the rest
    are encoded), and between waves the worker reads its inbox (streams are detokenized
    meanwhile). The size keeps doubling while prompts keep coming (a burst that trickles in
    from the API server is soon taken whole, as it queued, in few batched calls) and starts
    over at 1 after `quiet_s` without a prompt."""

    def __init__(self, quiet_s: float = 0.02, clock: Callable[[], float] = time.monotonic):
        self.reqs: list[TokenizeReq] = []
        self.size = 1
        self.quiet_s = quiet_s
        self.clock = clock
        self.last = -math.inf  # when a prompt last came

    def __bool__(self) -> bool:
        return bool(self.reqs)

    def add(self, reqs: list[TokenizeReq]) -> None:
        if not reqs:
            return
        now = self.clock()
        if not self.reqs and now - self.last > self.quiet_s:
            self.size = 1
        self.last = now
        self.reqs.extend(reqs)

    def drop(self, uids: set[int]) -> None:
        if uids and self.reqs:
            self.reqs = [r for r in self.reqs if r.uid not in uids]

    def take(self) -> list[TokenizeReq]:
        wave, self.reqs = self.reqs[: self.size], self.reqs[self.size :]
        self.size = min(self.size * 2, MAX_WAVE)
        return wave


def run_tokenizer_worker(
    index: int,
    model_path: str,
    ipc_dir: str,
    typed: bool,
    dp: int = 1,
    chat_template: str | None = None,
) -> None:
    """`dp` engine replicas: a request's messages go to engine worker `replica_of(uid)`;
    `chat_template`: the server's `--chat-template` text (None: the model's)."""
    name = ipc.tokenizer_name(index)
    proc = ipc.WorkerProcess(ipc_dir, ipc.FRONTEND)
    codec = Codec(typed)

    def build() -> tuple[zmq.Socket, list[zmq.Socket], TokenizerWorker]:
        inbox = ipc.pull(proc.ctx, ipc_dir, name)
        to_engines = [ipc.push(proc.ctx, ipc_dir, ipc.scheduler_name(i)) for i in range(dp)]
        return inbox, to_engines, TokenizerWorker(load_tokenizer(model_path, chat_template), codec)

    started = proc.start(build, lambda err: codec.encode(Ready(name, os.getpid(), error=err)))
    if started is None:
        return
    inbox, to_engines, worker = started
    info = {"max_token_chars": max_token_chars(worker.tok), "warmup_ms": worker.warm_up()}
    proc.ready(
        lambda frozen: codec.encode(Ready(name, os.getpid(), info=info | {"gc_frozen": frozen}))
    )
    wire = Wiring(codec, inbox, to_engines, proc.report, dp)
    proc.serve(lambda: serve(worker, wire, proc.alive))


@dataclass
class Wiring:
    """A tokenizer worker's sockets: its inbox, the engine workers (a request's messages go to
    `replica_of(uid)`'s), the API server."""

    codec: Codec
    inbox: zmq.Socket
    to_engines: list[zmq.Socket]
    to_frontend: zmq.Socket
    dp: int

    def to_engine(self, msg: AddReq | AbortReq | FinishReq) -> None:
        self.to_engines[replica_of(msg.uid, self.dp)].send(self.codec.encode(msg))

    def to_api(self, msg: DetokOut | Reject) -> None:
        self.to_frontend.send(self.codec.encode(msg))


def serve(worker: TokenizerWorker, wire: Wiring, alive: Callable[[], bool]) -> None:
    """Until Shutdown (or the launcher is gone): each turn reads the inbox, detokenizes the
    engines' tokens first (running streams do not wait behind new prompts' tokenization), then
    takes the aborts and rejects, then tokenizes one wave of the backlog."""
    backlog = Backlog()
    while alive():
        frames = ipc.drain(wire.inbox, 0 if backlog else 500)
        msgs = [wire.codec.decode(f) for f in frames]
        if any(isinstance(m, Shutdown) for m in msgs):
            break
        tok_reqs = [m for m in msgs if isinstance(m, TokenizeReq)]
        if tok_reqs:
            trace.mark("tok.recv", [r.uid for r in tok_reqs])
        aborts = {m.uid for m in msgs if isinstance(m, AbortReq)}
        outs = [m for m in msgs if isinstance(m, TokenOut)]
        if outs:
            uids = [u for o in outs for u in o.uids.tolist()] if trace.enabled() else []
            trace.mark("tok.out", uids)
            detok, finishes = worker.detokenize(outs)
            trace.mark("tok.detok", uids)
            for f in finishes:
                wire.to_engine(f)
            if detok is not None:
                wire.to_api(detok)
        backlog.add(tok_reqs)
        backlog.drop(aborts)
        for uid in aborts:
            worker.forget(uid)
            wire.to_engine(AbortReq(uid))
        for m in msgs:
            if isinstance(m, Reject):  # from the scheduler: drop state, tell the client
                worker.forget(m.uid)
                wire.to_api(m)
        if backlog:
            tokenize_wave(worker, wire, backlog.take())


def tokenize_wave(worker: TokenizerWorker, wire: Wiring, wave: list[TokenizeReq]) -> None:
    """One wave of prompts tokenized and sent to their engines (a failure rejects the wave)."""
    try:
        adds, rejects = worker.tokenize(wave)
    except Exception as e:  # a tokenizer bug must not kill the worker
        adds = []
        rejects = [Reject(r.uid, f"tokenizer error: {e!r}", 500, "internal_error") for r in wave]
    trace.mark("tok.sent", [a.uid for a in adds])
    for a in adds:
        wire.to_engine(a)
    for r in rejects:
        wire.to_api(r)
