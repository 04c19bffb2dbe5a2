"""A broadcast 'something changed' for several independent waiters."""

from __future__ import annotations

import asyncio

from services.common.timeouts import within


class ChangeSignal:
    """Wakes every waiter on each change; unlike one shared asyncio.Event, no waiter clears it for the others."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    def since_now(self) -> asyncio.Event:
        """An event that is set by the next change after this call."""
        return self._event


async def wait_or_timeout(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether event was set within timeout_s; a cancellation of the caller always propagates (within)."""
    try:
        await within(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True
