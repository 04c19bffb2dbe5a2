"""A request's service-level objective and how a finished request is classified against it. Pure.

One definition for the live KPI (the router classifies every stream it relays) and the simulator:
a request succeeds when it finished within its own budgets — time to first token, mean time per
output token after the first, and its end-to-end deadline — each the cluster's default where the
request sets none (0). Dynamo's goodput definition (TTFT 5 s, ITL 100 ms) is the default default.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

DEFAULT_TTFT_BUDGET_MS = 5000
DEFAULT_TPOT_BUDGET_MS = 100


class Outcome(enum.IntEnum):
    """How a request ended; the values are the wire's RequestOutcome."""

    SUCCEEDED = 1
    LATE = 2
    FAILED = 3
    CANCELLED = 4


@dataclass(frozen=True)
class Slo:
    """Budgets in ms; a deadline of 0 is none."""

    ttft_ms: float = DEFAULT_TTFT_BUDGET_MS
    tpot_ms: float = DEFAULT_TPOT_BUDGET_MS
    deadline_ms: float = 0

    def for_request(self, ttft_budget_ms: float = 0, tpot_budget_ms: float = 0, deadline_ms: float = 0) -> Slo:
        """The request's own budgets, these defaults where it sets none."""
        return Slo(ttft_budget_ms or self.ttft_ms, tpot_budget_ms or self.tpot_ms, deadline_ms or self.deadline_ms)

    def is_met(self, ttft_ms: float, tpot_ms: float | None, elapsed_ms: float) -> bool:
        """Whether a request that finished met every budget (tpot_ms None: it made one token or none)."""
        return (ttft_ms <= self.ttft_ms and (tpot_ms is None or tpot_ms <= self.tpot_ms)
                and (not self.deadline_ms or elapsed_ms <= self.deadline_ms))


def classify(slo: Slo, *, finished: bool, cancelled: bool = False, ttft_ms: float | None = None,
             tpot_ms: float | None = None, elapsed_ms: float = 0.0) -> Outcome:
    """A request's outcome: cancelled by its client, failed (never finished), late, or succeeded."""
    if cancelled:
        return Outcome.CANCELLED
    if not finished or ttft_ms is None:
        return Outcome.FAILED
    return Outcome.SUCCEEDED if slo.is_met(ttft_ms, tpot_ms, elapsed_ms) else Outcome.LATE
