"""A request's outputs on their way from the frontend's inbox to its HTTP handler: the items
(a choice's new text, its failure, its admission) and the `Mailbox` that holds them."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from minisgl.server.protocol import APIError


@dataclass(frozen=True, slots=True)
class Chunk:
    """New text of one choice (`finish`: its finish reason once it ended)."""

    index: int
    text: str
    finish: str | None
    logprobs: list | None = None  # [[token, logprob, [[token, logprob], ...]], ...]


@dataclass(frozen=True, slots=True)
class Failure:
    """One choice failed (bad prompt, engine error, worker gone, shutdown)."""

    index: int
    error: APIError


@dataclass(frozen=True, slots=True)
class Accepted:
    """One choice passed validation and is queued in the scheduler."""

    index: int


Item = Chunk | Failure | Accepted


class _Text:
    """A choice's unread new text in a mailbox (parts joined when read)."""

    __slots__ = ("finish", "index", "logprobs", "parts")

    def __init__(self, index: int, text: str, finish: str | None, logprobs: list | None) -> None:
        self.index = index
        self.parts = [text]
        self.finish = finish
        self.logprobs = list(logprobs) if logprobs else None

    def chunk(self) -> Chunk:
        text = self.parts[0] if len(self.parts) == 1 else "".join(self.parts)
        return Chunk(self.index, text, self.finish, self.logprobs)


class Gone:
    """Put in a job's mailbox when its client disconnected: wakes the waiting handler."""


GONE = Gone()


class Mailbox:
    """A job's outputs in arrival order, for its one handler. A choice's new text merges into
    the choice's unread chunk when that is the last item (a handler that fell behind sends one
    SSE event for what accumulated; never past a finish), and the waiting handler is woken once
    however many rows arrived meanwhile: no object, queue put or wake-up per row."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None

    def __bool__(self) -> bool:
        return bool(self.items)

    def put(self, item: Item | Gone) -> None:
        self.items.append(item)
        self._wake()

    def put_text(self, index: int, text: str, finish: str | None, logprobs: list | None) -> None:
        items = self.items
        last = items[-1] if items else None
        if type(last) is _Text and last.index == index and last.finish is None:
            last.parts.append(text)
            last.finish = finish
            if logprobs:
                if last.logprobs is None:
                    last.logprobs = []
                last.logprobs.extend(logprobs)
            return  # unread: its handler is awake already
        items.append(_Text(index, text, finish, logprobs))
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():  # a cancelled wait
                w.set_result(None)

    def pop(self) -> Item | Gone:
        item = self.items.popleft()
        return item.chunk() if type(item) is _Text else item

    async def wait(self) -> None:
        """Until an item is there (returns at once if one is)."""
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
