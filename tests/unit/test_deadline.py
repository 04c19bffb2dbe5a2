"""A stream cut off at its deadline: what was handed out stays, the producer is closed, the error names it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.common.deadline import until

pytestmark = pytest.mark.timeout(10)


class Passed(Exception):
    pass


async def test_items_before_the_deadline_stand_and_the_producer_is_closed_at_it() -> None:
    gate = asyncio.Event()
    closed = asyncio.Event()

    async def producer():
        try:
            yield 1
            yield 2
            await gate.wait()  # never set: the third item would come after the deadline
            yield 3
        finally:
            closed.set()

    received = []
    deadline_at = asyncio.get_running_loop().time() + 0.2
    with pytest.raises(Passed):
        async for item in until(producer(), deadline_at, Passed):
            received.append(item)
    assert received == [1, 2]
    assert closed.is_set()


async def test_no_deadline_passes_everything_through() -> None:
    async def producer():
        for i in range(3):
            yield i

    assert [i async for i in until(producer(), None, Passed)] == [0, 1, 2]


async def test_a_passed_deadline_cuts_off_a_stream_whose_items_are_ready() -> None:
    """A source that hands out items without waiting (the router's coalescing of a backlog, for a client
    slower than its tokens) is cut off at the deadline all the same: nothing is handed out after it."""
    async def ready():
        for item in range(5):
            yield item

    received = []
    with pytest.raises(Passed):
        async for item in until(ready(), asyncio.get_running_loop().time() - 1, Passed):
            received.append(item)
    assert received == []


def _answer(now: list[float]) -> AsyncIterator[str]:
    """A token and a finished answer, through until() with a deadline at 10 on the clock now[0]."""
    async def answer() -> AsyncIterator[str]:
        yield "token"
        yield "finished"

    return until(answer(), 10.0, Passed, last=lambda item: item == "finished", clock=lambda: now[0])


async def test_a_deadline_passed_after_the_last_item_does_not_cut_off_the_streams_end() -> None:
    # The answer was finished within its deadline; its consumer (a slow client's write) asked for the end after it.
    now = [0.0]
    stream = _answer(now)
    assert [await anext(stream), await anext(stream)] == ["token", "finished"]
    now[0] = 11.0  # past the deadline before the consumer asks for more
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_a_deadline_passed_before_the_last_item_still_cuts_off_the_stream() -> None:
    now = [0.0]
    stream = _answer(now)
    assert await anext(stream) == "token"
    now[0] = 11.0
    with pytest.raises(Passed):
        await anext(stream)
