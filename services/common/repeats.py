"""A failure that repeats while a peer is away, logged at its first and then once in a while, not at every retry.

Pure: time is passed in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

# How often a failure that keeps repeating is logged again, with how many came since.
REPEAT_LOG_EVERY_S = 30.0


class Repeats:
    """One retry loop's failures: logged at the first of a run of them, then once every every_s with their count, and
    its recovery once (a service that could not reach etcd logged 4 to 5 lines a second, a node agent whose kvindex
    was away 2 every 0.5 s: helper-175)."""

    def __init__(self, logger: logging.Logger, every_s: float = REPEAT_LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._every_s = every_s
        self._clock = clock
        self._said_at: float | None = None  # when the run of failures was last logged; None: no run
        self._said = ""  # what was logged then
        self._unsaid = 0  # failures since

    @property
    def failing(self) -> bool:
        return self._said_at is not None

    def failed(self, message: str, *args: object) -> None:
        """A WARNING of message % args, unless the same was logged within every_s (another failure is said at once)."""
        now = self._clock()
        said = message % args
        if self._said_at is not None and now - self._said_at < self._every_s and said == self._said:
            self._unsaid += 1
            return
        more = f" (after {self._unsaid} more like the last logged)" if self._unsaid else ""
        self._log.warning("%s%s", said, more)
        self._said_at, self._said, self._unsaid = now, said, 0

    def succeeded(self, message: str, *args: object) -> None:
        """An INFO of message % args if a run of failures ends here, with the count of those not logged."""
        if self._said_at is not None:
            more = f" ({self._unsaid} more failures not logged)" if self._unsaid else ""
            self._log.info("%s%s", message % args, more)
        self._said_at, self._said, self._unsaid = None, "", 0
