"""Whether a vLLM engine is making progress on the requests in flight. Pure: the engine gives it the clock.

vLLM tells an engine core's death (AsyncLLM.errored), not a hang: an engine core stopped, or stuck in a kernel,
held its streams for as long as their clients waited, since the node's heartbeats said the node lived, and took
every new request placed there (helper-191). A hang is the time with requests in flight since the last sign of
progress, an output of any of them; an idle engine is not hung, and a request that left with no output (its client
gave up, or the router moved it) is no progress: the time it was in flight counts on into the next one's.
"""

from __future__ import annotations


class ProgressWatch:
    def __init__(self, hung_after_s: float) -> None:
        # 0: never taken as hung.
        self.hung_after_s = hung_after_s
        # When the present time in flight with no output began; None while nothing is in flight.
        self._since: float | None = None
        # The time in flight with no output before it, since the last output, and when the engine last went idle.
        self._carried_s = 0.0
        self._idle_since = 0.0

    def admitted(self, now: float, num_in_flight: int) -> None:
        """A request was admitted with num_in_flight others running: with none, a time in flight begins now, and
        what was carried lapses if the engine was idle for hung_after_s (a long prefill now and then whose client gave
        up must not add up, over hours, to a healthy engine taken as hung, helper-205)."""
        if num_in_flight == 0 or self._since is None:
            if now - self._idle_since >= self.hung_after_s:
                self._carried_s = 0.0
            self._since = now

    def output(self, now: float) -> None:
        """vLLM gave an output of a request in flight."""
        self._since, self._carried_s = now, 0.0

    def left(self, now: float, num_in_flight: int) -> None:
        """A request left the engine (finished or aborted), num_in_flight still running: with none, the time in
        flight since the last output is carried to the next admission. (Each admission to an empty engine started
        the clock afresh: a stopped engine core whose clients gave up within the limit was never taken as hung,
        and took every request placed there, helper-203.)"""
        if num_in_flight == 0 and self._since is not None:
            self._carried_s += max(0.0, now - self._since)
            self._since, self._idle_since = None, now

    def not_watched(self, now: float, seconds: float) -> None:
        """The watcher could not look for the seconds before now (its own process was paused): no output of that
        time has been read yet, so it is nobody's. (A node agent paused 65 s took its healthy engine for hung as it
        woke, and exited, helper-203.) Never past now: an output read as the process woke already restarted the
        clock, and the pause added on top hid a hang for as long again (helper-205)."""
        if self._since is not None:
            self._since = min(self._since + seconds, now)

    def hung_s(self, now: float, num_in_flight: int) -> float | None:
        """How long the engine has made no progress with requests in flight, once that is past hung_after_s."""
        if not (self.hung_after_s and num_in_flight) or self._since is None:
            return None
        stuck_s = self._carried_s + now - self._since
        return stuck_s if stuck_s > self.hung_after_s else None
