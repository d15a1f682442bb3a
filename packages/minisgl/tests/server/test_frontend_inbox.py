"""The API server reads its workers' messages on its event loop once serving.

A receiver thread had to take the GIL from the event loop for every poll, frame and hand-over:
while the loop was busy (requests arriving, streams writing) each take waited up to the
interpreter's switch interval (5 ms), and a request's first token sat in the socket for up to
~8 ms of a ~12 ms TTFT (seed-online traces, issue 39). Before the loop starts (waiting for the
workers' Ready) the thread still reads; it stops when the loop takes over the socket."""

from __future__ import annotations

import asyncio
import shutil
import threading

import zmq

from minisgl import ipc
from minisgl.message.schema import Codec, DetokOut, Ready
from minisgl.server.args import parse_args
from minisgl.server.frontend import Frontend, Job, ReqState
from minisgl.server.mailbox import Chunk


def recv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "minisgl-recv" and t.is_alive()]


def test_the_event_loop_takes_over_the_inbox(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    ipc_dir = ipc.make_ipc_dir("/tmp")
    fe = Frontend(parse_args(["--model-path", model]), model, ipc_dir)
    ctx = zmq.Context()
    push = ipc.push(ctx, ipc_dir, ipc.FRONTEND)
    codec = Codec(True)
    try:
        push.send(codec.encode(Ready("tokenizer-0", 1)))
        assert "tokenizer-0" in fe.wait_ready(["tokenizer-0"], 10, lambda: None)
        assert recv_threads() == ["minisgl-recv"]  # before serving: the thread reads

        async def main() -> tuple[list, list, str]:
            fe.attach_loop(asyncio.get_running_loop())
            job = Job([])
            st = ReqState(7, 0, job.mailbox)
            job.states.append(st)
            fe.reqs[7] = st
            await asyncio.sleep(0.05)
            threads = recv_threads()
            push.send(codec.encode(DetokOut([7], ["hi"], [1], [None], [3])))
            await asyncio.wait_for(job.mailbox.wait(), 10)
            first = job.mailbox.pop()
            for i, text in enumerate("abc"):  # later messages keep coming through
                push.send(
                    codec.encode(DetokOut([7], [text], [1], ["stop" if i == 2 else None], [3]))
                )
            items: list = []
            while not items or items[-1].finish is None:
                await asyncio.wait_for(job.mailbox.wait(), 10)
                items.append(job.mailbox.pop())
            return threads, [first, *items], "".join(c.text for c in [first, *items])

        threads, chunks, text = asyncio.run(main())
        assert threads == []  # serving: no receiver thread
        assert chunks[0] == Chunk(0, "hi", None)
        assert text == "hiabc" and chunks[-1].finish == "stop"
        assert fe.reqs[7].completion_tokens == 4
    finally:
        fe.close()
        push.close(linger=0)
        ctx.term()
        shutil.rmtree(ipc_dir, ignore_errors=True)
