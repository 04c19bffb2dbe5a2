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

    def allowance(self, now: float) -> float:
        """Retries allowed in the current window."""
        self._expire(now)
        return self.min_retries_per_s * self.window_s + self.ratio * len(self._requests)

    def record_request(self, now: float) -> None:
        self._expire(now)
        self._requests.append(now)

    def try_retry(self, now: float) -> bool:
        """Spend one retry if the budget allows it."""
        allowance = self.allowance(now)  # expires old retries too, before they are counted
        if len(self._retries) + 1 > allowance:
            return False
        self._retries.append(now)
        return True

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
