"""Read a stream eagerly and hand its consumer what piled up in the meantime as one merged item."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


async def coalesce(
    source: AsyncIterator[T],
    merge: Callable[[list[T]], T],
    *,
    min_interval_s: float = 0.0,
    max_pending: int = 1024,
    key: Callable[[T], object] | None = None,
) -> AsyncIterator[T]:
    """Items of source; those that arrive while the consumer is busy, or within min_interval_s of
    the last item handed out, come merged into one.

    The interval is for consumers that cannot say they are behind: a gRPC server stream's write
    completes as soon as the client's HTTP/2 window has room, and that window holds about a
    thousand small messages, so a slow client's backlog sits in its own receive buffer, one
    message per item. The first item goes out at once, and so does everything pending when the
    source ends. Only consecutive items with equal key (all, without one) are merged.

    Memory: at most max_pending items wait. When that many do, the reader stops reading source
    (its producer feels the back-pressure: gRPC flow control) until the consumer takes them.
    Closing this iterator cancels the reader and closes source, at once even when its consumer is
    cancelled again while it waits for that (the close then goes on without it).
    """
    if max_pending < 1 or min_interval_s < 0:
        raise ValueError(f"coalesce: max_pending must be >= 1 and min_interval_s >= 0, got {max_pending}, "
                         f"{min_interval_s}")
    loop = asyncio.get_running_loop()
    pending: list[T] = []
    arrived = asyncio.Event()  # an item came, or the source ended
    urgent = asyncio.Event()  # pending is full, or the source ended: hand out without waiting
    taken = asyncio.Event()
    done = False
    failure: BaseException | None = None

    async def read() -> None:
        nonlocal done, failure
        try:
            async for item in source:
                pending.append(item)
                arrived.set()
                while len(pending) >= max_pending:
                    urgent.set()
                    taken.clear()
                    await taken.wait()
        except Exception as exc:  # noqa: BLE001 - handed to the consumer below
            failure = exc
        finally:
            done = True
            arrived.set()
            urgent.set()

    reader = asyncio.create_task(read())
    next_out_at = -math.inf
    try:
        while True:
            while not pending and not done:
                arrived.clear()
                await arrived.wait()
            hold_s = next_out_at - loop.time()
            if hold_s > 0 and not done and len(pending) < max_pending:
                urgent.clear()
                try:
                    async with asyncio.timeout(hold_s):
                        await urgent.wait()
                except TimeoutError:
                    pass
            if pending:
                count = len(pending)
                if key is not None:
                    first = key(pending[0])
                    count = next((i for i, item in enumerate(pending) if key(item) != first), count)
                batch = pending[:count]
                del pending[:count]
                taken.set()
                next_out_at = loop.time() + min_interval_s
                yield merge(batch)
            elif done:
                if failure is not None:
                    raise failure
                return
    finally:
        reader.cancel()
        # The close runs in a task of its own, shielded: a consumer cancelled again while it waits still has its
        # source closed as soon as the reader has stopped, not whenever the source is collected.
        closing = asyncio.ensure_future(_close_after(reader, source))
        _closing.add(closing)
        closing.add_done_callback(_closing.discard)
        try:
            await asyncio.shield(closing)
        except asyncio.CancelledError:
            closing.add_done_callback(_log_failure)  # no one awaits it now to hear how it ended
            raise


# Closes under way, held until they end (the event loop keeps only weak references to tasks).
_closing: set[asyncio.Future[None]] = set()


def _log_failure(closing: asyncio.Future[None]) -> None:
    if not closing.cancelled() and (exc := closing.exception()) is not None:
        log.warning("coalesce: closing the source failed after its consumer was cancelled: %r", exc)


async def _close_after(reader: asyncio.Task[None], source: AsyncIterator[T]) -> None:
    # wait() neither raises the reader's cancellation nor hides one aimed at us.
    await asyncio.wait([reader])
    # A reader cancelled while it waited for room left source paused at a yield: its cleanup (a relay's
    # notice to the leader) runs now, not whenever it is collected.
    if isinstance(source, AsyncGenerator):
        await source.aclose()
