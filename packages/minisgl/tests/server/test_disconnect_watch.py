"""A request's `Job` notices its client leaving through one task that awaits the connection's
`http.disconnect`: `next_item` then raises `ClientGone` at once, however long the request has
waited for output, and never polls the connection between items (it did every 0.1 s, with a
timer around every wait: `request.is_disconnected` opens an anyio cancel scope each call)."""

from __future__ import annotations

import asyncio

import pytest

from minisgl.server.frontend import ClientGone, Job, next_item
from minisgl.server.mailbox import Chunk


def new_job() -> Job:
    return Job([])


def disconnect_after(seconds: float):
    """An ASGI `receive` whose client leaves after `seconds`."""

    async def receive():
        await asyncio.sleep(seconds)
        return {"type": "http.disconnect"}

    return receive


def test_a_disconnect_wakes_a_request_that_waits_for_output():
    async def main() -> None:
        job = new_job()
        job.watch(disconnect_after(0.01))
        try:
            with pytest.raises(ClientGone):
                await asyncio.wait_for(next_item(job), 5)
            assert job.gone
        finally:
            job.unwatch()

    asyncio.run(main())


def test_items_flow_while_the_client_stays():
    async def main() -> None:
        job = new_job()
        job.watch(disconnect_after(3600))
        try:
            job.mailbox.put_text(0, "a", None, None)
            assert await next_item(job) == Chunk(0, "a", None)
            asyncio.get_running_loop().call_later(0.01, job.mailbox.put_text, 0, "b", "stop", None)
            assert await next_item(job) == Chunk(0, "b", "stop")
        finally:
            job.unwatch()
        await asyncio.sleep(0)
        assert job.watcher is not None and job.watcher.cancelled()

    asyncio.run(main())


def test_a_disconnect_ends_the_request_with_output_still_queued():
    async def main() -> None:
        job = new_job()
        job.mailbox.put_text(0, "a", None, None)
        job.watch(disconnect_after(0))
        await asyncio.sleep(0.01)  # the watcher saw the disconnect
        with pytest.raises(ClientGone):
            await next_item(job)
        job.unwatch()

    asyncio.run(main())


def test_other_messages_keep_the_watcher_waiting():
    msgs = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if msgs:
            return msgs.pop()
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def main() -> None:
        job = new_job()
        job.watch(receive)
        await asyncio.sleep(0.01)
        assert not job.gone
        job.unwatch()

    asyncio.run(main())
