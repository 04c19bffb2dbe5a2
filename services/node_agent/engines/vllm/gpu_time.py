"""Per-request GPU time for an engine that reports no per-request step timings. Pure, no I/O.

vLLM runs every scheduled request in one batched step. The engine's busy time is shared evenly
among the requests it holds at each moment (processor sharing): between two events (a request
arrives or ends) each of the n requests held is charged elapsed / n. The charges add up to the
engine's busy wall time; a request waiting in vLLM's queue is charged as if it ran, and prefill
and decode tokens weigh the same — an approximation, stated as one.
"""

from __future__ import annotations


class GpuTimeShare:
    """Charges elapsed engine time to the requests held, shared evenly; times in seconds."""

    def __init__(self) -> None:
        self._charged_ms: dict[str, float] = {}
        self._last = 0.0

    def _advance(self, now: float) -> None:
        if self._charged_ms and now > self._last:
            share_ms = (now - self._last) * 1000.0 / len(self._charged_ms)
            for request_id in self._charged_ms:
                self._charged_ms[request_id] += share_ms
        self._last = max(self._last, now)

    def start(self, request_id: str, now: float) -> None:
        self._advance(now)
        self._charged_ms[request_id] = 0.0

    def gpu_ms(self, request_id: str, now: float) -> float:
        """The request's share so far (0 for one not held)."""
        self._advance(now)
        return self._charged_ms.get(request_id, 0.0)

    def finish(self, request_id: str, now: float) -> float:
        """Stop charging the request; its total share."""
        self._advance(now)
        return self._charged_ms.pop(request_id, 0.0)
