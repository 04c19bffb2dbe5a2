"""A vLLM engine that stops giving outputs with requests in flight is taken as hung; an idle one never is."""

from __future__ import annotations

import pytest

from services.node_agent.config import NodeAgentConfig
from services.node_agent.engines.vllm.progress import ProgressWatch


def test_an_engine_is_hung_only_with_requests_in_flight_and_no_output_past_the_limit() -> None:
    """A stopped engine core held its streams as long as their clients waited and took every new request, since
    only its death was watched (helper-191)."""
    watch = ProgressWatch(hung_after_s=60.0)
    assert watch.hung_s(1000.0, 0) is None  # idle for ever: not hung
    watch.admitted(1000.0, 0)  # the first request after a long idle starts the clock
    assert watch.hung_s(1059.0, 1) is None
    watch.output(1050.0)
    assert watch.hung_s(1109.0, 1) is None
    assert watch.hung_s(1111.0, 1) == pytest.approx(61.0)
    watch.admitted(1111.0, 1)  # another admitted beside a stuck one does not reset the clock
    assert watch.hung_s(1112.0, 2) == pytest.approx(62.0)
    assert watch.hung_s(1112.0, 0) is None  # all aborted: nothing in flight
    assert ProgressWatch(hung_after_s=0.0).hung_s(10_000.0, 5) is None  # 0: never


def test_the_hung_limit_is_zero_or_more() -> None:
    assert NodeAgentConfig(engine_hung_s=0.0).engine_hung_s == 0.0
    with pytest.raises(ValueError, match=r"--engine-hung-s: must be 0 \(never\) or more, got -1"):
        NodeAgentConfig(engine_hung_s=-1.0)
