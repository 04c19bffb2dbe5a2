"""Request rate per client connection: a token bucket each. Pure: the caller passes the time.

A connection is what the front end says it is (the gRPC peer, the HTTP transport's peer address),
one TCP connection each. Memory is bounded: a bucket left idle long enough to refill is the same
as a new one and is dropped, and past max_connections the least recently used bucket goes.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

# Connections tracked at once; past it the least recently used one forgets its bucket.
DEFAULT_MAX_CONNECTIONS = 65_536


@dataclass
class _Bucket:
    tokens: float
    updated_at: float


class ConnectionRates:
    """Allows each connection rate_per_s requests a second on average and burst at once."""

    def __init__(self, rate_per_s: float, burst: int, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        if rate_per_s <= 0 or not math.isfinite(rate_per_s):
            raise ValueError(f"rate_per_s: must be positive and finite, got {rate_per_s}")
        if burst < 1:
            raise ValueError(f"burst: must be positive, got {burst}")
        if max_connections < 1:
            raise ValueError(f"max_connections: must be positive, got {max_connections}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_connections = max_connections
        # Least recently used first; a bucket idle this long is full again, so it can be forgotten.
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._full_after_s = burst / rate_per_s

    def __len__(self) -> int:
        """Connections tracked now."""
        return len(self._buckets)

    def acquire(self, connection: str, now: float) -> float:
        """Take one request from connection's bucket: 0.0 if it may go now, else the seconds until
        it could (the request is refused and takes nothing)."""
        self._forget_idle(now)
        bucket = self._buckets.pop(connection, None)
        if bucket is None:
            bucket = _Bucket(float(self.burst), now)
            while len(self._buckets) >= self.max_connections:
                self._buckets.popitem(last=False)
        else:
            elapsed = max(0.0, now - bucket.updated_at)
            bucket.tokens = min(float(self.burst), bucket.tokens + elapsed * self.rate_per_s)
            bucket.updated_at = max(bucket.updated_at, now)
        self._buckets[connection] = bucket
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate_per_s

    def _forget_idle(self, now: float) -> None:
        while self._buckets:
            oldest = next(iter(self._buckets.values()))
            if now - oldest.updated_at < self._full_after_s:
                return
            self._buckets.popitem(last=False)
