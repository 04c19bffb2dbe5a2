"""The per-connection request rate: a burst, then the rate; each connection on its own; bounded memory."""

from __future__ import annotations

import pytest

from services.router.connection_rate import ConnectionRates


def test_a_burst_goes_at_once_and_the_next_request_waits_for_the_rate() -> None:
    rates = ConnectionRates(rate_per_s=10, burst=3)
    assert [rates.acquire("a", now=0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rates.acquire("a", now=0.0) == pytest.approx(0.1)
    assert rates.acquire("a", now=0.05) == pytest.approx(0.05)  # half a token back: half the wait
    assert rates.acquire("a", now=0.1) == 0.0
    assert rates.acquire("a", now=0.1) == pytest.approx(0.1)


def test_a_refused_request_takes_nothing_from_its_connection() -> None:
    rates = ConnectionRates(rate_per_s=1, burst=1)
    assert rates.acquire("a", now=0.0) == 0.0
    for _ in range(5):  # hammering while over the limit does not push the next allowed request later
        assert rates.acquire("a", now=0.5) > 0
    assert rates.acquire("a", now=1.0) == 0.0


def test_one_connection_over_its_rate_leaves_the_others_theirs() -> None:
    rates = ConnectionRates(rate_per_s=1, burst=2)
    assert [rates.acquire("flood", now=0.0) for _ in range(4)][2:] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert [rates.acquire("calm", now=0.0) for _ in range(2)] == [0.0, 0.0]


def test_the_bucket_refills_only_up_to_the_burst() -> None:
    rates = ConnectionRates(rate_per_s=100, burst=2)
    rates.acquire("a", now=0.0)
    assert [rates.acquire("a", now=1000.0) for _ in range(3)][2] > 0


def test_idle_connections_are_forgotten_and_their_number_is_capped() -> None:
    rates = ConnectionRates(rate_per_s=10, burst=5, max_connections=3)
    for i in range(10):
        rates.acquire(f"c{i}", now=0.0)
    assert len(rates) == 3
    # A bucket idle long enough to be full again is dropped: it would allow a whole burst anyway.
    rates.acquire("late", now=0.5)
    assert len(rates) == 1
    assert [rates.acquire("c9", now=0.5) for _ in range(5)] == [0.0] * 5


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="rate_per_s"):
        ConnectionRates(rate_per_s=0, burst=1)
    with pytest.raises(ValueError, match="burst"):
        ConnectionRates(rate_per_s=1, burst=0)
