"""Awaiting with a time limit, without ever losing the caller's cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """awaitable's result, or TimeoutError (the awaitable cancelled) once timeout_s has passed; None: no limit.

    Use it instead of asyncio.wait_for: on Python 3.11, when the caller is cancelled just as the
    awaitable completes, wait_for returns the result and the cancellation is lost, so a loop around
    it (a stream relay, a dispatcher) runs on after its task was cancelled: a client that left keeps
    its tokens generating, a service that stops waits for ever. asyncio.timeout keeps it.

    A limit already spent (0 or less) times out after one turn of the event loop, as wait_for's does,
    and never runs the awaitable (a coroutine is closed, a future cancelled; other awaitables are
    dropped): under asyncio.timeout an awaitable that completes without yielding to the event loop
    (a stream with items ready) would return its result however late it was.
    """
    if timeout_s is not None and timeout_s <= 0:
        if isinstance(awaitable, Coroutine):
            awaitable.close()
        elif isinstance(awaitable, asyncio.Future):
            if awaitable.done():
                return awaitable.result()
            awaitable.cancel()
        await asyncio.sleep(0)  # one turn of the loop, as wait_for's: a loop calling this must not starve others
        raise TimeoutError
    async with asyncio.timeout(timeout_s):
        return await awaitable


# Of a call's time, what a wait inside it (for leadership, a model, etcd's view) leaves for the reply: a refusal sent
# after the caller's deadline is a bare DEADLINE_EXCEEDED to it, and a Finished notice refused so is lost.
REPLY_RESERVE_S = 0.2


def usable_s(remaining_s: float | None) -> float | None:
    """Of a call's remaining time (None: no deadline), what a wait inside it may use."""
    return None if remaining_s is None else max(0.0, remaining_s - REPLY_RESERVE_S)
