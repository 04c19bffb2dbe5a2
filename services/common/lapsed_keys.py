"""Keys that vanished from etcd, held for a grace period in case their holder puts them back. Pure.

An etcd that freezes for longer than the lease TTL expires every lease at once when it resumes,
live holders' included; each holder re-grants and re-puts within a moment. A reader that acted on
the deletions at once would drop every live process; one that holds them for a grace period sees
nothing happen. Time is passed in.
"""

from __future__ import annotations


class LapsedKeys:
    """A prefix's keys as etcd lists them, plus those gone from it less than grace_s ago."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._present: dict[str, bytes] = {}
        # Each lapsed key's last value and when it vanished.
        self._lapsed: dict[str, tuple[bytes, float]] = {}

    def update(self, present: dict[str, bytes], now: float, leaving: frozenset[str] = frozenset()) -> None:
        """etcd now lists present; keys in leaving were given up by their holder and are not held."""
        if self.grace_s > 0:
            for key, value in self._present.items():
                if key not in present and key not in leaving:
                    self._lapsed[key] = (value, now)
        for key in [*present, *leaving]:
            self._lapsed.pop(key, None)
        self._present = dict(present)
        self.expire(now)

    def expire(self, now: float) -> list[str]:
        """Drop the keys whose grace has ended; which they were."""
        ended = [key for key, (_, since) in self._lapsed.items() if now - since >= self.grace_s]
        for key in ended:
            del self._lapsed[key]
        return ended

    def view(self) -> dict[str, bytes]:
        """Every key present or lapsed, with its latest value."""
        held = {key: value for key, (value, _) in self._lapsed.items()}
        return {**held, **self._present}

    def lapsed(self) -> frozenset[str]:
        """Keys in view() that etcd no longer lists."""
        return frozenset(self._lapsed)

    def next_expiry(self) -> float | None:
        """When the next grace ends; None when nothing is lapsed."""
        if not self._lapsed:
            return None
        return min(since for _, since in self._lapsed.values()) + self.grace_s
