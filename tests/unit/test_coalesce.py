"""coalesce(): items one by one to a fast consumer, merged for a slow one; errors and closing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest

from services.common import coalesce as coalesce_module
from services.common.coalesce import coalesce

pytestmark = pytest.mark.timeout(10)

# Bounds waits that would hang if coalesce lost the end of its source; it answers in a few loop turns.
GUARD_S = 0.5


def _merge(batches: list[list[int]]) -> list[int]:
    return [item for batch in batches for item in batch]


class Boom(Exception):
    pass


async def test_fast_consumer_gets_items_one_by_one() -> None:
    taken: asyncio.Queue[None] = asyncio.Queue()

    async def source() -> AsyncIterator[list[int]]:
        for i in range(3):
            yield [i]
            await taken.get()  # the next item only after the consumer has this one

    got = []
    async with aclosing(coalesce(source(), _merge)) as items:
        async for item in items:
            got.append(item)
            taken.put_nowait(None)
    assert got == [[0], [1], [2]]


async def test_slow_consumer_gets_pending_items_merged() -> None:
    go, produced, closed = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def source() -> AsyncIterator[list[int]]:
        try:
            yield [0]
            await go.wait()
            for i in (1, 2, 3):
                yield [i]
            produced.set()
            await asyncio.Event().wait()  # stays open
        finally:
            closed.set()

    async with aclosing(coalesce(source(), _merge)) as items:
        assert await anext(items) == [0]
        go.set()
        await produced.wait()  # the consumer is busy while the source produces three items
        assert await anext(items) == [1, 2, 3]
    assert closed.is_set()


async def test_source_error_reaches_consumer_after_its_items() -> None:
    taken = asyncio.Event()

    async def source() -> AsyncIterator[list[int]]:
        yield [0]
        await taken.wait()
        raise Boom("engine died")

    async with aclosing(coalesce(source(), _merge)) as items:
        assert await anext(items) == [0]
        taken.set()
        with pytest.raises(Boom, match="engine died"):
            await anext(items)


async def test_closing_the_consumer_early_cancels_the_reader() -> None:
    closed = asyncio.Event()

    async def source() -> AsyncIterator[list[int]]:
        try:
            yield [0]
            await asyncio.Event().wait()
        finally:
            closed.set()

    items = coalesce(source(), _merge)
    assert await anext(items) == [0]
    await items.aclose()
    assert closed.is_set()
    assert asyncio.all_tasks() == {asyncio.current_task()}



async def test_closing_the_consumer_while_the_backlog_is_full_closes_the_source() -> None:
    # The reader waits for room with the source paused at a yield: the source's cleanup must run at the close, not
    # when it is collected (a router's relay told the leader how its request ended there, and the notice was lost).
    asked_for_second, closed = asyncio.Event(), asyncio.Event()

    async def source() -> AsyncIterator[list[int]]:
        try:
            yield [1]
            asked_for_second.set()
            yield [2]  # pending is full with it: the reader waits for the consumer
            yield [3]
        finally:
            closed.set()

    items = coalesce(source(), _merge, max_pending=1)
    assert await anext(items) == [1]
    await asyncio.wait_for(asked_for_second.wait(), GUARD_S)
    await items.aclose()
    assert closed.is_set()

async def _cancel_twice_while_closing(source: AsyncIterator[list[int]]) -> None:
    """Consume coalesce(source) one item at a time (max_pending 1), take the first item, then cancel the consumer
    twice: the second while it waits for the reader to stop (as a caller that cancels twice, a gRPC handler torn
    down while its stream closes, does)."""
    got_first = asyncio.Event()

    async def consume() -> None:
        async with aclosing(coalesce(source, _merge, max_pending=1)) as items:
            async for _ in items:
                got_first.set()
                await asyncio.Event().wait()

    consumer = asyncio.create_task(consume())
    await asyncio.wait_for(got_first.wait(), GUARD_S)
    consumer.cancel()
    # Runs after the consumer's next step (the loop runs callbacks in order): it has cancelled the reader and
    # waits for it, and this cancels that wait.
    asyncio.get_running_loop().call_soon(consumer.cancel)
    with pytest.raises(asyncio.CancelledError):
        await consumer


async def test_a_consumer_cancelled_again_while_closing_still_closes_the_source() -> None:
    # The source paused at a yield must still be closed at once, not when it is collected.
    closed = asyncio.Event()

    async def source() -> AsyncIterator[list[int]]:
        try:
            yield [1]
            yield [2]  # pending is full with it: the reader waits for the consumer
            yield [3]
        finally:
            closed.set()

    held = source()  # referenced here, so only a close (not the collector) can end it
    await _cancel_twice_while_closing(held)
    await asyncio.wait_for(closed.wait(), GUARD_S)


async def test_stream_ends_after_items_pending_when_the_source_finished() -> None:
    async def source() -> AsyncIterator[list[int]]:
        for i in range(3):
            yield [i]

    async with asyncio.timeout(GUARD_S), aclosing(coalesce(source(), _merge)) as items:
        got = [item async for item in items]
    assert _merge(got) == [0, 1, 2]


async def test_source_error_reaches_consumer_after_items_pending_when_it_failed() -> None:
    go, failed = asyncio.Event(), asyncio.Event()

    async def source() -> AsyncIterator[list[int]]:
        yield [0]
        await go.wait()
        yield [1]
        yield [2]
        failed.set()
        raise Boom("engine died")

    async with asyncio.timeout(GUARD_S), aclosing(coalesce(source(), _merge)) as items:
        assert await anext(items) == [0]
        go.set()
        await failed.wait()
        assert await anext(items) == [1, 2]
        with pytest.raises(Boom, match="engine died"):
            await anext(items)


async def test_items_within_the_interval_are_merged_and_the_end_goes_out_at_once() -> None:
    """A consumer that cannot say it is behind (a gRPC client's buffer) still gets few items."""
    first_taken = asyncio.Event()

    async def source() -> AsyncIterator[list[int]]:
        yield [0]
        await first_taken.wait()
        for i in range(1, 6):
            yield [i]

    # An hour's interval: nothing but the source's end may hand out the rest before the guard.
    async with asyncio.timeout(GUARD_S), aclosing(coalesce(source(), _merge, min_interval_s=3600)) as items:
        assert await anext(items) == [0]  # the first at once
        first_taken.set()
        got = [item async for item in items]
    assert got == [[1, 2, 3, 4, 5]]


async def test_only_items_with_the_same_key_are_merged() -> None:
    first_taken = asyncio.Event()

    async def source() -> AsyncIterator[list[int]]:
        yield [1]
        await first_taken.wait()
        for i in (2, 10, 11, 3):
            yield [i]

    async with asyncio.timeout(GUARD_S), aclosing(
        coalesce(source(), _merge, min_interval_s=3600, key=lambda item: item[0] // 10)
    ) as items:
        assert await anext(items) == [1]
        first_taken.set()
        got = [item async for item in items]
    assert got == [[2], [10, 11], [3]]


async def test_a_full_backlog_stops_the_reader_until_the_consumer_takes_it() -> None:
    produced = 0

    async def source() -> AsyncIterator[list[int]]:
        nonlocal produced
        while True:
            produced += 1
            yield [produced]

    async with asyncio.timeout(GUARD_S), aclosing(coalesce(source(), _merge, max_pending=3)) as items:
        first = await anext(items)  # the consumer now holds this, and takes nothing more
        for _ in range(50):  # every task but the reader is idle: give it many turns
            await asyncio.sleep(0)
        assert produced == len(first) + 3  # three pending; the source is not read on
        assert await anext(items) == [len(first) + 1, len(first) + 2, len(first) + 3]


async def test_a_source_that_fails_to_close_after_a_second_cancellation_is_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    # No one awaits the close once its consumer is cancelled again: its failure is logged, not left to the loop's
    # "exception was never retrieved".
    failed = asyncio.Event()

    async def source() -> AsyncIterator[list[int]]:
        try:
            yield [1]
            yield [2]  # pending is full with it: the reader waits for the consumer
        finally:
            failed.set()
            raise Boom("cannot close")

    held = source()
    await _cancel_twice_while_closing(held)
    await asyncio.wait_for(failed.wait(), GUARD_S)
    closing = next(iter(coalesce_module._closing), None)
    if closing is not None:  # not yet through its callbacks
        await asyncio.wait([closing])
    assert "closing the source failed" in caplog.text and "cannot close" in caplog.text
