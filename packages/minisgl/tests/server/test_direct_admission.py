"""The python backend's requests go from the API server straight to the engine (issue 39).

The API server tokenizes (as SGLang's TokenizerManager does) and sends `AddReq` to the engine;
the engine, on admitting a request, sends its detokenizer a `DetokOpen` (the stop strings, the
special-token setting, the prompt's length) on the socket its tokens will follow, so the state
is always there before the first token; an abort travels the same way. A seed-online first
token crossed a process more before (API server -> tokenizer worker -> engine): ~0.7 ms p50 and
~4 ms p90 on the 2-core machine, plus the wait behind the worker's batch of other prompts.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import shutil

import numpy as np
import pytest
import zmq

from minisgl.message import schema
from minisgl.message.schema import AbortReq, AddReq, Codec, Reject, TokenOut, WireParams
from minisgl.server import ipc
from minisgl.server.api_server import Frontend
from minisgl.server.args import parse_args
from minisgl.server.protocol import APIError, parse_chat, parse_completion

CARD = "P1-016"
RED = "direct-admission-tests-fail-before-the-api-server-tokenizes"
GREEN = "direct-admission-tests-pass"


def detok_open_cls():
    cls = getattr(schema, "DetokOpen", None)
    assert cls is not None, "minisgl.message.schema has no DetokOpen message"
    return cls


def encoder_module():
    assert importlib.util.find_spec("minisgl.tokenizer.encode") is not None, (
        "no minisgl.tokenizer.encode (the API server's prompt encoder)"
    )
    return importlib.import_module("minisgl.tokenizer.encode")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))


class Sockets:
    """A python-backend Frontend and PULL sockets in place of its engine and tokenizer."""

    def __init__(self, model: str, extra: list[str] | None = None) -> None:
        self.ipc_dir = ipc.make_ipc_dir("/tmp")
        self.ctx = zmq.Context()
        self.engine = ipc.pull(self.ctx, self.ipc_dir, ipc.scheduler_name(0))
        self.tokenizer = ipc.pull(self.ctx, self.ipc_dir, ipc.tokenizer_name(0))
        self.fe = Frontend(parse_args(["--model-path", model, *(extra or [])]), model, self.ipc_dir)
        self.fe.serving = True
        self.codec = Codec(True)

    def take(self, sock, want: int, timeout_s: float = 5.0) -> list:
        msgs: list = []
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while len(msgs) < want and poller.poll(int(timeout_s * 1000)):
            msgs.append(self.codec.decode(sock.recv()))
        return msgs

    def close(self) -> None:
        self.fe.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


@pytest.fixture
def sockets(tiny_model_dir):
    """A Frontend (python backend, the tiny Llama) and the PULLs in place of its workers; closed
    on every way out (an open ZMQ context blocks the interpreter's exit)."""
    sk = Sockets(str(tiny_model_dir("llama")))
    try:
        yield sk
    finally:
        sk.close()


async def never() -> dict:
    await asyncio.Event().wait()
    return {}


@pytest.mark.card(
    CARD, "the-api-server-tokenizes-and-sends-requests-straight-to-the-engine", RED, GREEN
)
def test_the_api_server_sends_tokenized_prompts_straight_to_the_engine(sockets, tok):
    """Text with the tokenizer's BOS, chat rendered without it (the HF calls' ids), n = 2
    choices with one prompt and the leader named, and the aborts of what did not finish: all
    to the engine; the tokenizer worker (now the detokenizer) gets nothing."""
    sk = sockets
    chat = [{"role": "user", "content": "Name three colors: ö ✓"}]
    names = sk.fe.model_names
    text = parse_completion({"model": sk.fe.model_name, "prompt": "héllo wörld"}, names, 256)
    talk = parse_chat({"model": sk.fe.model_name, "messages": chat, "n": 2}, names, 256)

    async def admit(parsed) -> list[int]:
        sk.fe.attach_loop(asyncio.get_running_loop())
        async with sk.fe.job(parsed, never) as job:
            return [st.uid for st in job.states]

    uids_text = asyncio.run(admit(text))
    uids_chat = asyncio.run(admit(talk))
    msgs = sk.take(sk.engine, 6)
    adds = [m for m in msgs if isinstance(m, AddReq)]
    aborts = [m.uid for m in msgs if isinstance(m, AbortReq)]
    assert [a.uid for a in adds] == uids_text + uids_chat, msgs
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    want_text = tok("héllo wörld", add_special_tokens=True)["input_ids"]
    want_chat = tok(rendered, add_special_tokens=False)["input_ids"]
    assert adds[0].input_ids.tolist() == want_text
    assert adds[1].input_ids.tolist() == adds[2].input_ids.tolist() == want_chat
    assert adds[1].params.prefix_leader == 0
    assert adds[2].params.prefix_leader == uids_chat[0]
    assert sorted(aborts) == sorted(uids_text + uids_chat)  # left unfinished: aborted
    assert sk.take(sk.tokenizer, 1, timeout_s=0.2) == []


@pytest.mark.card(
    CARD, "the-api-server-tokenizes-and-sends-requests-straight-to-the-engine", RED, GREEN
)
def test_a_prompt_that_cannot_be_rendered_is_a_400_and_nothing_is_sent(sockets, monkeypatch):
    sk = sockets
    enc = getattr(sk.fe, "encoder", None)
    assert enc is not None, "the API server has no prompt encoder"

    def broken(*a, **k):
        raise ValueError("the template cannot render this")

    monkeypatch.setattr(enc.tok, "apply_chat_template", broken)
    talk = parse_chat(
        {"model": sk.fe.model_name, "messages": [{"role": "user", "content": "hi"}]},
        sk.fe.model_names,
        256,
    )

    async def admit():
        sk.fe.attach_loop(asyncio.get_running_loop())
        async with sk.fe.job(talk, never):
            pass

    with pytest.raises(APIError) as info:
        asyncio.run(admit())
    assert info.value.status == 400 and "render" in str(info.value.message)
    assert sk.fe.reqs == {}
    assert sk.take(sk.engine, 1, timeout_s=0.2) == []


@pytest.mark.card(
    CARD, "the-api-server-tokenizes-and-sends-requests-straight-to-the-engine", RED, GREEN
)
def test_a_long_prompt_is_encoded_off_the_event_loop(sockets):
    """Prompts are encoded in a thread (the backend's batched encode releases the GIL): the
    event loop keeps serving the other streams meanwhile, also while a long prompt encodes."""
    encoder_module()
    sk = sockets
    long = "lorem ipsum dolor sit amet, é✓ " * 1600
    parsed = parse_completion({"model": sk.fe.model_name, "prompt": long}, sk.fe.model_names, 10**6)

    async def admit() -> tuple[int, int]:
        sk.fe.attach_loop(asyncio.get_running_loop())
        ticks = 0
        done = asyncio.Event()

        async def tick() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        before = ticks
        async with sk.fe.job(parsed, never):
            during = ticks - before
        done.set()
        await ticker
        return during, len(long)

    during, _ = asyncio.run(admit())
    (add,) = sk.take(sk.engine, 1)
    assert isinstance(add, AddReq) and len(add.input_ids) > 1000
    assert during >= 5, f"the loop ran {during} times while the prompt was encoded"


class FakeSocket:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def send(self, frame: bytes) -> None:
        self.frames.append(frame)

    def msgs(self) -> list:
        return [Codec.decode(f) for f in self.frames]


class FakeRuntime:
    def __init__(self) -> None:
        from types import SimpleNamespace

        self.scheduler = None
        self.engine = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100))
        self.added: list[int] = []
        self.aborted: list[int] = []

    def add(self, ids, params, rid: int, leader=None) -> None:
        self.added.append(rid)

    def abort(self, uid: int) -> None:
        self.aborted.append(uid)


@pytest.mark.card(
    CARD, "the-engine-opens-each-request-s-detokenizer-state-before-its-first-token", RED, GREEN
)
def test_the_engine_opens_the_detokenizer_state_and_forwards_aborts():
    """On admission the engine tells the request's detokenizer (uid % workers) its stop strings,
    special-token setting and prompt length, on the socket its tokens will follow; an abort
    follows the same way; a request it refuses opens nothing (its Reject goes that way)."""
    from minisgl.server.engine_worker import EngineLoop

    DetokOpen = detok_open_cls()
    rt, toks, front = FakeRuntime(), [FakeSocket(), FakeSocket()], FakeSocket()
    loop = EngineLoop(rt, Codec(True), toks, front)
    p = WireParams(stop=["\n\n", "END"], skip_special_tokens=False, max_tokens=4)
    loop.handle(AddReq(7, np.arange(5, dtype=np.int32), p))
    loop.handle(AddReq(8, np.array([1, 2, 300], dtype=np.int32), WireParams()))  # out of vocab
    loop.handle(AbortReq(7))
    assert rt.added == [7] and rt.aborted == [7]
    opened, abort = toks[1].msgs()
    assert isinstance(opened, DetokOpen)
    assert (opened.uid, opened.prompt_tokens) == (7, 5)
    assert list(opened.stop) == ["\n\n", "END"] and opened.skip_special_tokens is False
    assert isinstance(abort, AbortReq) and abort.uid == 7
    (reject,) = toks[0].msgs()
    assert isinstance(reject, Reject) and reject.uid == 8


@pytest.mark.card(
    CARD, "the-detokenizer-worker-streams-from-the-states-the-engine-opened", RED, GREEN
)
def test_the_detokenizer_streams_from_an_opened_state(tok):
    """Text, stop strings and the prompt's token count come from the engine's `DetokOpen`;
    tokens of a uid it never opened (or closed) are dropped."""
    from minisgl.tokenizer import worker as w

    DetokOpen = detok_open_cls()
    cls = getattr(w, "DetokenizerWorker", None)
    assert cls is not None, "minisgl.tokenizer.worker has no DetokenizerWorker"
    d = cls(tok, Codec(True))
    ids = tok("The quick brown fox jumps", add_special_tokens=False)["input_ids"]
    d.open(DetokOpen(3, 11, ["fox"], True))
    d.open(DetokOpen(4, 2, [], True))
    d.drop(4)
    first = TokenOut(np.array([3], dtype=np.int64), np.array([ids[0]], dtype=np.int32), [None])
    out, finishes = d.detokenize([first])
    texts = [out.texts[0]] if out else []
    for t in ids[1:]:
        out, fin = d.detokenize(
            [
                TokenOut(
                    np.array([3, 4], dtype=np.int64), np.array([t, t], dtype=np.int32), [None] * 2
                )
            ]
        )
        finishes += fin
        if out:
            assert out.uids == [3] and out.prompt_tokens == [11]
            texts.append(out.texts[0])
    assert "".join(texts) == "The quick brown "
    assert [(f.uid, f.reason) for f in finishes] == [(3, "stop")]
    assert d.states == {}
