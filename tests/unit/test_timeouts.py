"""A cancellation that arrives just as an awaited result does is never lost (Python 3.11's
asyncio.wait_for returned the result and dropped it: a stream relay whose client left, or a service
being stopped, ran on)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.common.deadline import until
from services.common.timeouts import within


async def test_within_returns_the_result_or_times_out() -> None:
    assert await within(asyncio.sleep(0, result="done"), 5) == "done"
    with pytest.raises(TimeoutError):
        await within(asyncio.Event().wait(), 0.01)


async def test_a_limit_already_spent_times_out_even_when_the_result_is_ready() -> None:
    ran = []

    async def ready() -> str:
        ran.append(True)
        return "late"

    with pytest.raises(TimeoutError):
        await within(ready(), 0)
    assert not ran  # never started (and closed: no "never awaited" warning)
    done = asyncio.get_running_loop().create_future()
    done.set_result("in time")
    assert await within(done, 0) == "in time"  # a result already there is not late


async def test_a_spent_limit_still_lets_the_event_loop_turn() -> None:
    """A loop that waits with a spent limit (an interval of 0) must not starve every other task."""
    others = asyncio.Event()
    asyncio.get_running_loop().call_soon(others.set)
    with pytest.raises(TimeoutError):
        await within(asyncio.Event().wait(), 0)
    assert others.is_set()


async def test_a_caller_cancelled_as_its_wait_completes_is_cancelled() -> None:
    arrived = asyncio.Queue[int]()
    waiter = asyncio.create_task(within(arrived.get(), 60))
    await asyncio.sleep(0)  # one turn: the waiter runs to its wait
    arrived.put_nowait(1)  # the awaited result comes ...
    waiter.cancel()  # ... and the cancellation, in the same turn
    done, _ = await asyncio.wait({waiter}, timeout=5)
    assert waiter in done and waiter.cancelled()


async def test_a_stream_whose_consumer_is_cancelled_as_a_token_arrives_stops() -> None:
    """The relay of a stream with a deadline: its consumer (a client's call) cancelled just as the next
    token arrives ends, and the stream's source is closed, instead of relaying on to its end."""
    tokens = asyncio.Queue[int]()
    closed = asyncio.Event()

    async def source() -> AsyncIterator[int]:
        try:
            while True:
                yield await tokens.get()
        finally:
            closed.set()

    relayed: list[int] = []

    async def relay() -> None:
        deadline_at = asyncio.get_running_loop().time() + 60
        async for token in until(source(), deadline_at, lambda: TimeoutError("deadline")):
            relayed.append(token)

    consumer = asyncio.create_task(relay())
    await asyncio.sleep(0)  # one turn: the relay runs to its wait for a token
    tokens.put_nowait(1)
    consumer.cancel()
    done, _ = await asyncio.wait({consumer}, timeout=5)
    assert consumer in done and consumer.cancelled()
    assert closed.is_set()
