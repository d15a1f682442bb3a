"""A stream that fell behind sends what accumulated for a choice as one SSE event: the job's
mailbox merges a choice's new text into its unread chunk as the rows arrive, and wakes the
waiting handler once, not once per row."""

from __future__ import annotations

import asyncio

from minisgl.server.frontend import next_item
from minisgl.server.mailbox import Accepted, Chunk, Failure, Mailbox
from minisgl.server.protocol import APIError


def filled(*items) -> Mailbox:
    box = Mailbox()
    for it in items:
        if isinstance(it, Chunk):
            box.put_text(it.index, it.text, it.finish, it.logprobs)
        else:
            box.put(it)
    return box


def drain(box: Mailbox) -> list:
    out = []
    while box:
        out.append(box.pop())
    return out


def test_unread_chunks_of_one_choice_merge_up_to_the_finish():
    box = filled(
        Chunk(0, "a", None, [["a", -0.5, []]]),
        Chunk(0, "b", None, [["b", -1.0, []]]),
        Chunk(0, "c", "stop"),
        Chunk(0, "x", None),
    )
    assert drain(box) == [
        Chunk(0, "abc", "stop", [["a", -0.5, []], ["b", -1.0, []]]),
        Chunk(0, "x", None),  # what follows the finish stays apart
    ]


def test_another_choice_or_kind_keeps_the_order():
    box = filled(Chunk(0, "a", None), Chunk(0, "b", None), Chunk(1, "z", None), Chunk(0, "c", None))
    assert drain(box) == [Chunk(0, "ab", None), Chunk(1, "z", None), Chunk(0, "c", None)]
    box = filled(Accepted(0), Chunk(0, "a", None), Chunk(0, "b", None))
    assert drain(box) == [Accepted(0), Chunk(0, "ab", None)]
    err = APIError(500, "engine error", None, "internal_error")
    box = filled(Chunk(0, "a", None), Failure(0, err), Chunk(0, "b", None))
    assert drain(box) == [Chunk(0, "a", None), Failure(0, err), Chunk(0, "b", None)]


def test_a_read_chunk_is_never_extended():
    box = filled(Chunk(0, "a", None))
    assert box.pop() == Chunk(0, "a", None)
    box.put_text(0, "b", None, None)
    assert drain(box) == [Chunk(0, "b", None)]


def test_the_waiting_handler_is_woken_once_for_a_batch_of_rows():
    async def main() -> tuple[list, int]:
        box = Mailbox()
        wakes = 0
        got: list = []

        async def handler() -> None:
            nonlocal wakes
            while len(got) < 2:
                if not box:
                    await box.wait()
                    wakes += 1
                got.append(box.pop())

        task = asyncio.get_running_loop().create_task(handler())
        await asyncio.sleep(0)  # the handler waits
        for t in "abcdefgh":  # one step's rows (one `_dispatch` call), all for this choice
            box.put_text(0, t, None, None)
        await asyncio.sleep(0)
        box.put_text(0, "!", "stop", None)
        await asyncio.wait_for(task, 1)
        return got, wakes

    got, wakes = asyncio.run(main())
    assert got == [Chunk(0, "abcdefgh", None), Chunk(0, "!", "stop")]
    assert wakes == 2


def test_a_cancelled_wait_leaves_the_mailbox_usable():
    async def main() -> Chunk:
        box = Mailbox()
        task = asyncio.get_running_loop().create_task(box.wait())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0)
        box.put_text(0, "a", None, None)  # no error from the cancelled waiter
        await box.wait()
        return box.pop()

    assert asyncio.run(main()) == Chunk(0, "a", None)


def test_next_item_reads_the_mailbox():
    from minisgl.server.frontend import Job

    async def main() -> list:
        job = Job([])
        job.mailbox.put(Accepted(0))
        job.mailbox.put_text(0, "a", None, None)
        job.mailbox.put_text(0, "b", "length", None)
        return [await next_item(job), await next_item(job)]

    assert asyncio.run(main()) == [Accepted(0), Chunk(0, "ab", "length")]
