"""Read a stream eagerly and hand a slow consumer everything pending as one merged item."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")


async def coalesce(source: AsyncIterator[T], merge: Callable[[list[T]], T]) -> AsyncIterator[T]:
    """Items of source; those that arrived while the consumer was busy come merged into one.

    Memory is bounded by what the source produces (one request's tokens), not by how
    slowly the consumer reads. Closing this iterator cancels the reader.
    """
    pending: list[T] = []
    ready = asyncio.Event()
    done = False
    failure: BaseException | None = None

    async def read() -> None:
        nonlocal done, failure
        try:
            async for item in source:
                pending.append(item)
                ready.set()
        except Exception as exc:  # noqa: BLE001 - handed to the consumer below
            failure = exc
        finally:
            done = True
            ready.set()

    reader = asyncio.create_task(read())
    try:
        while True:
            if not pending and not done:
                await ready.wait()
            ready.clear()
            if pending:
                items = pending[:]
                pending.clear()
                yield merge(items)
            elif done:
                if failure is not None:
                    raise failure
                return
    finally:
        reader.cancel()
        # wait() neither raises the reader's cancellation nor hides one aimed at us.
        await asyncio.wait([reader])
