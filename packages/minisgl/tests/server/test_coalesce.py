"""A stream that fell behind sends what accumulated for a choice as one SSE event."""

from __future__ import annotations

import asyncio

from minisgl.server.api_server import Accepted, Chunk, Job, coalesce


def job_with(*items) -> Job:
    q: asyncio.Queue = asyncio.Queue()
    for it in items:
        q.put_nowait(it)
    return Job([], q)


def test_queued_chunks_of_one_choice_merge_up_to_the_finish():
    job = job_with(
        Chunk(0, "b", None, [["b", -1.0, []]]), Chunk(0, "c", "stop"), Chunk(0, "x", None)
    )
    got = coalesce(job, Chunk(0, "a", None, [["a", -0.5, []]]))
    assert got == Chunk(0, "abc", "stop", [["a", -0.5, []], ["b", -1.0, []]])
    assert job.queue.qsize() == 1 and not job.held  # what follows the finish stays queued


def test_another_choice_or_kind_is_held_back_in_order():
    job = job_with(Chunk(0, "b", None), Chunk(1, "z", None), Chunk(0, "c", None))
    assert coalesce(job, Chunk(0, "a", None)) == Chunk(0, "ab", None, None)
    assert job.held == [Chunk(1, "z", None)] and job.queue.qsize() == 1
    job = job_with(Accepted(0))
    assert coalesce(job, Chunk(0, "a", None)) == Chunk(0, "a", None)
    assert job.held == [Accepted(0)]


def test_a_finished_chunk_is_never_merged_with_later_items():
    job = job_with(Chunk(0, "b", None))
    assert coalesce(job, Chunk(0, "a", "length")) == Chunk(0, "a", "length")
    assert job.queue.qsize() == 1
