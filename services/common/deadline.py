"""An async stream cut off at a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from services.common.timeouts import within

T = TypeVar("T")


async def until(source: AsyncIterator[T], deadline_at: float | None,
                passed: Callable[[], BaseException], *, last: Callable[[T], bool] | None = None,
                clock: Callable[[], float] | None = None) -> AsyncIterator[T]:
    """Items of source until clock (the event loop's) reaches deadline_at (None: no deadline); then
    source is closed (its producer cancelled) and passed() is raised. Items already handed out stay
    with the consumer. Once an item for which last() is true is handed out, the deadline is met: the
    end of source that follows it is not cut off, however long its consumer took to ask for it (a
    client slow to take a finished answer did not get an error after it)."""
    now = clock or asyncio.get_running_loop().time
    try:
        while True:
            remaining = None if deadline_at is None else max(0.0, deadline_at - now())
            try:
                item = await within(anext(source), remaining)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise passed() from None
            if last is not None and last(item):
                deadline_at = None
            yield item
    finally:
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()
