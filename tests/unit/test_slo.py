"""One outcome classifier for the live KPI and the simulator: a request's own budgets, defaults where unset."""

from __future__ import annotations

import pytest

from services.common.slo import Outcome, Slo, classify

pytestmark = pytest.mark.timeout(10)

DEFAULTS = Slo(ttft_ms=5000, tpot_ms=100)


def test_a_request_is_held_to_its_own_budgets_and_the_defaults_where_it_sets_none() -> None:
    assert DEFAULTS.for_request() == DEFAULTS
    assert DEFAULTS.for_request(ttft_budget_ms=1000, tpot_budget_ms=30, deadline_ms=9000) == Slo(1000, 30, 9000)
    assert DEFAULTS.for_request(tpot_budget_ms=30) == Slo(5000, 30, 0)


@pytest.mark.parametrize(("ttft_ms", "tpot_ms", "elapsed_ms", "outcome"), [
    (900, 29, 5000, Outcome.SUCCEEDED),
    (1001, 29, 5000, Outcome.LATE),  # first token too late
    (900, 31, 5000, Outcome.LATE),  # tokens too slow: the TPOT budget is part of the SLO
    (900, 29, 9001, Outcome.LATE),  # past the end-to-end deadline
    (900, None, 900, Outcome.SUCCEEDED),  # one token: no TPOT to judge
])
def test_a_finished_request_succeeds_only_within_every_budget(ttft_ms, tpot_ms, elapsed_ms, outcome) -> None:
    slo = DEFAULTS.for_request(ttft_budget_ms=1000, tpot_budget_ms=30, deadline_ms=9000)
    assert classify(slo, finished=True, ttft_ms=ttft_ms, tpot_ms=tpot_ms, elapsed_ms=elapsed_ms) == outcome


def test_unfinished_and_cancelled_requests() -> None:
    assert classify(DEFAULTS, finished=False, ttft_ms=10) == Outcome.FAILED
    assert classify(DEFAULTS, finished=True, ttft_ms=None) == Outcome.FAILED
    assert classify(DEFAULTS, finished=False, cancelled=True) == Outcome.CANCELLED
