"""Awaiting with a time limit, without ever losing the caller's cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """awaitable's result, or TimeoutError after timeout_s (None: no limit; the awaitable is cancelled).

    Use it instead of asyncio.wait_for: on Python 3.11, when the caller is cancelled just as the
    awaitable completes, wait_for returns the result and the cancellation is lost, so a loop around
    it (a stream relay, a dispatcher) runs on after its task was cancelled: a client that left keeps
    its tokens generating, a service that stops waits for ever. asyncio.timeout keeps it.
    """
    async with asyncio.timeout(timeout_s):
        return await awaitable
