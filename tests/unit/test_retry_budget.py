"""The cluster's retry budget: a reserve plus a fraction of recent requests, over a sliding window."""

from __future__ import annotations

import pytest

from services.scheduler.retry_budget import RetryBudget


def _spend(budget: RetryBudget, now: float, attempts: int = 100) -> int:
    """How many of `attempts` retries at `now` the budget grants."""
    return sum(budget.try_retry(now) for _ in range(attempts))


def test_without_requests_only_the_reserve_is_allowed() -> None:
    budget = RetryBudget(ratio=0.5, min_retries_per_s=0.5, window_s=4.0)
    assert budget.allowance(0.0) == 2.0
    assert _spend(budget, 0.0) == 2
    assert budget.num_retries(0.0) == 2


def test_each_request_adds_ratio_of_a_retry() -> None:
    budget = RetryBudget(ratio=0.25, min_retries_per_s=0.0, window_s=10.0)
    for i in range(8):
        budget.record_request(float(i) / 10)
    assert budget.num_requests(1.0) == 8
    assert budget.allowance(1.0) == 2.0
    assert _spend(budget, 1.0) == 2


def test_a_fractional_allowance_rounds_down() -> None:
    budget = RetryBudget(ratio=0.5, min_retries_per_s=0.0, window_s=10.0)
    for _ in range(3):
        budget.record_request(0.0)
    assert _spend(budget, 0.0) == 1


def test_requests_and_reserve_add_up() -> None:
    budget = RetryBudget(ratio=0.5, min_retries_per_s=0.25, window_s=4.0)
    for _ in range(4):
        budget.record_request(0.0)
    assert _spend(budget, 1.0) == 3


def test_a_refused_retry_spends_nothing() -> None:
    budget = RetryBudget(ratio=1.0, min_retries_per_s=0.0, window_s=10.0)
    budget.record_request(0.0)
    assert budget.try_retry(0.0)
    assert not budget.try_retry(0.0)
    assert not budget.try_retry(0.0)
    assert budget.num_retries(0.0) == 1
    # One more request makes room for exactly one more retry: the refusals took nothing.
    budget.record_request(0.0)
    assert _spend(budget, 0.0) == 1


def test_zero_ratio_and_zero_reserve_refuses_every_retry() -> None:
    budget = RetryBudget(ratio=0.0, min_retries_per_s=0.0, window_s=10.0)
    for _ in range(100):
        budget.record_request(0.0)
    assert _spend(budget, 0.0) == 0
    assert budget.num_retries(0.0) == 0


def test_requests_older_than_the_window_stop_counting() -> None:
    budget = RetryBudget(ratio=1.0, min_retries_per_s=0.0, window_s=10.0)
    budget.record_request(0.0)
    budget.record_request(5.0)
    assert budget.num_requests(9.0) == 2
    assert budget.num_requests(12.0) == 1
    assert budget.allowance(12.0) == 1.0
    assert budget.num_requests(16.0) == 0
    assert _spend(budget, 16.0) == 0


def test_retries_older_than_the_window_stop_counting_once_counted() -> None:
    budget = RetryBudget(ratio=0.0, min_retries_per_s=0.1, window_s=10.0)
    assert budget.try_retry(0.0)
    assert not budget.try_retry(5.0)
    assert budget.num_retries(11.0) == 0
    assert budget.try_retry(11.0)


def test_a_retry_older_than_the_window_does_not_block_the_next_one() -> None:
    budget = RetryBudget(ratio=0.0, min_retries_per_s=0.1, window_s=10.0)
    assert budget.try_retry(0.0)
    assert budget.try_retry(11.0)


def test_a_mass_failure_moves_what_the_budget_allows_and_refuses_the_rest() -> None:
    budget = RetryBudget(ratio=0.1, min_retries_per_s=0.2, window_s=10.0)
    for i in range(100):
        budget.record_request(i * 0.05)
    # Reserve 2 + 10% of 100 requests.
    assert _spend(budget, 5.0, attempts=50) == 12


@pytest.mark.parametrize(
    ("ratio", "min_retries_per_s", "window_s"),
    [(-0.1, 1.0, 10.0), (0.1, -1.0, 10.0), (0.1, 1.0, 0.0), (0.1, 1.0, -5.0)],
)
def test_invalid_arguments_are_value_errors(ratio: float, min_retries_per_s: float, window_s: float) -> None:
    with pytest.raises(ValueError, match="retry budget"):
        RetryBudget(ratio, min_retries_per_s, window_s)
