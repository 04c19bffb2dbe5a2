"""One outcome classifier for the live KPI and the simulator: a request's own budgets, defaults where unset."""

from __future__ import annotations

import pytest

from services.common.slo import DEFAULT_TPOT_BUDGET_MS, Outcome, Slo, classify

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


def test_the_router_counts_a_stream_too_slow_per_token_as_late_with_the_cluster_default() -> None:
    from baton.v1 import common_pb2, router_pb2, scheduler_pb2
    from services.router.relay import _outcome

    request = router_pb2.GenerateRequest(model="m", prompt="hi")
    length = common_pb2.FINISH_REASON_LENGTH
    # 11 tokens over 1.5 s after the first: 150 ms a token, over the 100 ms default.
    # (started_at, arrived_at, first token, last token, tokens, now)
    assert _outcome(length, request, DEFAULTS, 0.0, 0.0, 0.2, 1.7, 11, 1.7) == scheduler_pb2.REQUEST_OUTCOME_LATE
    assert _outcome(length, request, DEFAULTS, 0.0, 0.0, 0.2, 0.7, 11, 0.7) == scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED
    # The request's own budget overrides the default.
    lax = router_pb2.GenerateRequest(model="m", prompt="hi", tpot_budget_ms=200)
    assert _outcome(length, lax, DEFAULTS, 0.0, 0.0, 0.2, 1.7, 11, 1.7) == scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED
    abort = common_pb2.FINISH_REASON_ABORT
    assert _outcome(abort, request, DEFAULTS, 0.0, 0.0, 0.2, 0.7, 11, 0.7) == scheduler_pb2.REQUEST_OUTCOME_CANCELLED



def test_the_scheduler_aims_at_the_clusters_default_budgets_for_requests_that_set_none() -> None:
    """--slo-tpot-ms reaches Baton's policy: a request without its own TPOT budget is held to it."""
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.policies import make_policy

    strict = SchedulerConfig(etcd="127.0.0.1:1", slo_tpot_ms=1)
    policy = make_policy(strict.policy, strict.prefill_load_scale, strict.slo_ttft_ms, strict.slo_tpot_ms)
    assert policy._default_tpot_budget_ms == 1
    assert make_policy("baton")._default_tpot_budget_ms == DEFAULT_TPOT_BUDGET_MS
