"""How long a lease surely lives, as its holder can tell without asking etcd: the pure part of leading.

etcd starts a lease's TTL afresh when it grants or refreshes it, at some moment after the
holder sent the request. So a lease refreshed by a request sent at `sent_at` lives at least
until `sent_at + ttl` on etcd's side, whatever happens next (a freeze, a partition, etcd
down). A holder that acts only before that instant, less a margin, never acts after etcd
could have let the lease go and handed its keys to someone else.
"""

from __future__ import annotations

import math


class LeaseDeadline:
    """The last instant (holder's monotonic clock) at which a lease surely still lives, less a margin."""

    def __init__(self, margin_s: float) -> None:
        if margin_s < 0:
            raise ValueError(f"margin_s: must not be negative, got {margin_s}")
        self.margin_s = margin_s
        self._expires_at = -math.inf

    @property
    def valid_until(self) -> float:
        """When the holder must stop acting on the lease: the earliest expiry etcd could apply, less the margin."""
        return self._expires_at - self.margin_s

    def renewed(self, sent_at: float, ttl_s: float) -> None:
        """etcd granted or refreshed the lease with ttl_s, in answer to a request sent at sent_at."""
        if ttl_s > 0:
            self._expires_at = max(self._expires_at, sent_at + ttl_s)

    def is_valid(self, now: float) -> bool:
        return now < self.valid_until

    def expire(self) -> None:
        """etcd said the lease is gone (or it was given up): nothing is valid until a new grant."""
        self._expires_at = -math.inf
