"""Whether a vLLM engine is making progress on the requests in flight. Pure: the engine gives it the clock.

vLLM tells an engine core's death (AsyncLLM.errored), not a hang: an engine core stopped, or stuck in a kernel,
held its streams for as long as their clients waited, since the node's heartbeats said the node lived, and took
every new request placed there (helper-191). A hang is the time since the last sign of progress: an output of any
request in flight, or the admission that ended a time with none in flight (an idle engine is not hung).
"""

from __future__ import annotations


class ProgressWatch:
    def __init__(self, hung_after_s: float) -> None:
        # 0: never taken as hung.
        self.hung_after_s = hung_after_s
        self._since = 0.0

    def admitted(self, now: float, num_in_flight: int) -> None:
        """A request was admitted with num_in_flight others running: with none, the clock starts now."""
        if num_in_flight == 0:
            self._since = now

    def output(self, now: float) -> None:
        """vLLM gave an output of a request in flight."""
        self._since = now

    def hung_s(self, now: float, num_in_flight: int) -> float | None:
        """How long the engine has made no progress with requests in flight, once that is past hung_after_s."""
        stuck_s = now - self._since
        if self.hung_after_s and num_in_flight and stuck_s > self.hung_after_s:
            return stuck_s
        return None
