"""Detokenizer worker process (python backend).

The engine opens a request's decode state (`DetokOpen`: its stop strings, special-token
setting and prompt length) when it admits it, on the socket its tokens then follow; tokens are
detokenized incrementally, in batches, with stop strings checked here: a hit tells the engine to
finish the request. Worker i serves the requests with uid % num_tokenizer == i. (The API server
tokenizes: `minisgl.tokenizer.encode`.)
"""

from __future__ import annotations

import os
import time
import traceback

import zmq

from minisgl.message.schema import (
    AbortReq,
    Codec,
    DetokOpen,
    DetokOut,
    FinishReq,
    Ready,
    Reject,
    Shutdown,
    TokenOut,
)
from minisgl.server import ipc
from minisgl.server.replicas import replica_of
from minisgl.tokenizer.detokenize import DecodeState, Detokenizer
from minisgl.tokenizer.load import load_tokenizer
from minisgl.utils import trace


class DetokenizerWorker:
    def __init__(self, tokenizer, codec: Codec) -> None:
        self.tok = tokenizer
        self.codec = codec
        self.detok = Detokenizer(tokenizer)
        self.states: dict[int, DecodeState] = {}
        self.pending_lp: dict[int, list] = {}  # uid -> [token id, lp, top ids, top lps] unsent

    def warm_up(self) -> float:
        """A streamed decode outside any request (the decoder's first calls). Leaves no state.
        Returns its wall time in ms."""
        t0 = time.perf_counter()
        ids = self.tok("Hello, world", add_special_tokens=False)["input_ids"][:8]
        state = DecodeState()
        for i, t in enumerate(ids):
            self.detok.update([(state, [t], "length" if i == len(ids) - 1 else None)])
        return (time.perf_counter() - t0) * 1e3

    def open(self, msg: DetokOpen) -> None:
        self.states[msg.uid] = DecodeState(
            stops=tuple(msg.stop or ()),
            skip_special_tokens=msg.skip_special_tokens,
            prompt_tokens=msg.prompt_tokens,
        )

    def drop(self, uid: int) -> None:
        self.states.pop(uid, None)
        self.pending_lp.pop(uid, None)

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


def run_detokenizer_worker(
    index: int, model_path: str, ipc_dir: str, typed: bool, dp: int = 1
) -> None:
    """`dp` engine replicas: a stop string's `FinishReq` goes to engine `replica_of(uid)`."""
    name = ipc.tokenizer_name(index)
    alive = ipc.setup_worker_process()
    ctx = zmq.Context()
    codec = Codec(typed)
    to_frontend = ipc.push(ctx, ipc_dir, ipc.FRONTEND)
    try:
        inbox = ipc.pull(ctx, ipc_dir, name)
        to_engines = [ipc.push(ctx, ipc_dir, ipc.scheduler_name(i)) for i in range(dp)]
        worker = DetokenizerWorker(load_tokenizer(model_path), codec)
    except Exception as e:
        to_frontend.send(codec.encode(Ready(name, os.getpid(), error=repr(e))))
        to_frontend.close(linger=1000)
        raise
    to_frontend.send(codec.encode(Ready(name, os.getpid(), info={"warmup_ms": worker.warm_up()})))
    try:
        while alive():
            outs: list[TokenOut] = []
            for frame in ipc.drain(inbox, 500):
                m = codec.decode(frame)
                if isinstance(m, Shutdown):
                    return
                if isinstance(m, TokenOut):
                    outs.append(m)
                    continue
                if outs:  # in order: tokens read before an open / abort / reject go first
                    detokenize(worker, outs, to_engines, to_frontend, dp)
                    outs = []
                if isinstance(m, DetokOpen):
                    worker.open(m)
                elif isinstance(m, AbortReq):
                    worker.drop(m.uid)
                elif isinstance(m, Reject):  # from the engine: drop state, tell the client
                    worker.drop(m.uid)
                    to_frontend.send(codec.encode(m))
            if outs:
                detokenize(worker, outs, to_engines, to_frontend, dp)
    except ipc.WorkerExit:
        pass
    except Exception:
        traceback.print_exc()
        raise
    finally:
        ctx.destroy(linger=0)


def detokenize(worker: DetokenizerWorker, outs: list[TokenOut], to_engines, to_frontend, dp):
    """One batch of token messages: the text to the API server, stop-string hits to the engine."""
    uids = [u for o in outs for u in o.uids.tolist()] if trace.enabled() else []
    trace.mark("tok.out", uids)
    detok, finishes = worker.detokenize(outs)
    trace.mark("tok.detok", uids)
    for f in finishes:
        to_engines[replica_of(f.uid, dp)].send(worker.codec.encode(f))
    if detok is not None:
        to_frontend.send(worker.codec.encode(detok))
