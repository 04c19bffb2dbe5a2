"""An async stream cut off at a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from services.common.timeouts import within

T = TypeVar("T")


async def until(source: AsyncIterator[T], deadline_at: float | None,
                passed: Callable[[], BaseException]) -> AsyncIterator[T]:
    """Items of source until the event loop's clock reaches deadline_at (None: no deadline); then
    source is closed (its producer cancelled) and passed() is raised. Items already handed out stay
    with the consumer."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            remaining = None if deadline_at is None else max(0.0, deadline_at - loop.time())
            try:
                item = await within(anext(source), remaining)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise passed() from None
            yield item
    finally:
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()
