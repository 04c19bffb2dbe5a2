"""A budget for retries (the cluster's migrations; the leader's hedged kvindex queries), in the spirit of gRPC retry
throttling. Pure."""

from __future__ import annotations

from collections import deque


class RetryBudget:
    """Retries may not exceed a fraction of requests over a sliding window, plus a small reserve.

    Allowed retries in the window = min_retries_per_s * window_s + ratio * first placements.
    A mass failure therefore moves what it can at once and refuses the rest, instead of turning
    every failed stream into a retry storm. Time is passed in.
    """

    def __init__(self, ratio: float, min_retries_per_s: float, window_s: float = 10.0) -> None:
        if ratio < 0 or min_retries_per_s < 0 or window_s <= 0:
            raise ValueError("retry budget: ratio and min_retries_per_s must be >= 0, window_s > 0")
        self.ratio = ratio
        self.min_retries_per_s = min_retries_per_s
        self.window_s = window_s
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        for times in (self._requests, self._retries):
            while times and times[0] <= horizon:
                times.popleft()

    def allowance(self, now: float, in_flight: int = 0) -> float:
        """Retries allowed in the current window: a share of the requests placed in it, or of those in flight (the
        streams a failure may have to move) when they are more. Counting only the window's, one node's death on a
        fleet of long streams placed earlier refused a sixth of its moves (helper-167: 10 of 60)."""
        self._expire(now)
        return self.min_retries_per_s * self.window_s + self.ratio * max(len(self._requests), in_flight)

    def record_request(self, now: float) -> None:
        self._expire(now)
        self._requests.append(now)

    def try_retry(self, now: float, in_flight: int = 0) -> bool:
        """Spend one retry if the budget allows it."""
        allowance = self.allowance(now, in_flight)  # expires old retries too, before they are counted
        if len(self._retries) + 1 > allowance:
            return False
        self._retries.append(now)
        return True

    def retry_after_s(self, now: float) -> float:
        """When a retry refused now may be tried again: once the oldest retry in the window has left it (the whole
        window when none is in it)."""
        self._expire(now)
        return self._retries[0] + self.window_s - now if self._retries else self.window_s

    def refund(self, spent_at: float) -> None:
        """Give back a retry spent at spent_at that did not happen (nothing to move to); a no-op
        once it has left the window."""
        try:
            self._retries.remove(spent_at)
        except ValueError:
            pass

    def num_retries(self, now: float) -> int:
        self._expire(now)
        return len(self._retries)

    def num_requests(self, now: float) -> int:
        self._expire(now)
        return len(self._requests)

    def restore(self, num_requests: int, num_retries: int, now: float) -> None:
        """Take over a predecessor's window (counts only: they start their window at now)."""
        self._requests.extend([now] * num_requests)
        self._retries.extend([now] * num_retries)
