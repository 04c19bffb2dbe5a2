"""Names that left the cluster's listing lately. Pure: time is passed in.

A model whose every node has gone (died, drained away, restarting) is an outage to retry through, not a model the
client got wrong: NOT_FOUND is a code no client retries. The router and the scheduler remember the models that left
their listing for a while, and answer UNAVAILABLE for one of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

# How long a model listed no more is answered as one to retry for. A node's host that died comes back, or an operator
# replaces it, within this in most outages; a model taken out of service for good is NOT_FOUND after it (at once on a
# router or scheduler started since, which never listed it).
GONE_MODEL_MEMORY_S = 3600.0

T = TypeVar("T")


class GoneFromListing(Generic[T]):
    """The names a listing held and holds no more, each with its value when it left, for memory_s after it left."""

    def __init__(self, memory_s: float = GONE_MODEL_MEMORY_S) -> None:
        self._memory_s = memory_s
        self._listed: dict[str, T] = {}
        self._gone: dict[str, tuple[T, float]] = {}

    def update(self, listing: Mapping[str, T], now: float) -> None:
        """listing is what is listed now."""
        for name, value in self._listed.items():
            if name not in listing:
                self._gone[name] = (value, now)
        self._gone = {name: gone for name, gone in self._gone.items()
                      if name not in listing and now - gone[1] <= self._memory_s}
        self._listed = dict(listing)

    def get(self, name: str, now: float) -> T | None:
        """name's value when it left the listing, if that was within memory_s of now and it is not listed again."""
        gone = self._gone.get(name)
        return gone[0] if gone is not None and now - gone[1] <= self._memory_s else None
