"""The cluster's retry budget: a reserve plus a fraction of recent requests, over a sliding window;
and how Place spends it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import json_format

from baton.v1 import common_pb2, scheduler_pb2
from services.common import etcd_keys
from services.common.load import Load
from services.common.telemetry import Telemetry
from services.scheduler.config import SchedulerConfig
from services.scheduler.policies import PlacementRequest
from services.scheduler.retry_budget import RetryBudget
from services.scheduler.servicer import SchedulerService
from tests.unit.leading import fake_leadership


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


def test_the_streams_in_flight_count_when_they_are_more_than_the_requests_placed_in_the_window() -> None:
    """Counting only the window's placements, one node's death on a fleet of long streams placed earlier refused a
    sixth of its moves (helper-167: 10 of 60, each a generation lost)."""
    budget = RetryBudget(ratio=0.2, min_retries_per_s=0.5, window_s=10.0)
    budget.record_request(0.0)
    assert budget.allowance(1.0, in_flight=60) == 5.0 + 12.0
    assert budget.allowance(1.0, in_flight=0) == 5.0 + 0.2
    assert sum(budget.try_retry(1.0, in_flight=60) for _ in range(30)) == 17


def test_a_refused_retry_is_told_when_the_oldest_retry_leaves_the_window() -> None:
    budget = RetryBudget(ratio=0.0, min_retries_per_s=0.2, window_s=10.0)
    assert budget.retry_after_s(0.0) == 10.0  # none in the window
    assert budget.try_retry(2.0) and budget.try_retry(3.0) and not budget.try_retry(4.0)
    assert budget.retry_after_s(4.0) == 8.0
    assert budget.try_retry(12.0)  # the one of 2.0 has left


@pytest.mark.parametrize(
    ("ratio", "min_retries_per_s", "window_s"),
    [(-0.1, 1.0, 10.0), (0.1, -1.0, 10.0), (0.1, 1.0, 0.0), (0.1, 1.0, -5.0)],
)
def test_invalid_arguments_are_value_errors(ratio: float, min_retries_per_s: float, window_s: float) -> None:
    with pytest.raises(ValueError, match="retry budget"):
        RetryBudget(ratio, min_retries_per_s, window_s)


def test_a_refund_gives_the_retry_back() -> None:
    budget = RetryBudget(ratio=0.0, min_retries_per_s=0.1, window_s=10.0)
    assert budget.try_retry(1.0)
    assert not budget.try_retry(1.0)
    budget.refund(1.0)
    assert budget.num_retries(1.0) == 0
    assert budget.try_retry(2.0)


def test_a_refund_after_the_window_has_moved_on_changes_nothing() -> None:
    budget = RetryBudget(ratio=0.0, min_retries_per_s=0.2, window_s=10.0)
    assert budget.try_retry(1.0)
    assert budget.try_retry(15.0)
    budget.refund(1.0)  # already out of the window
    assert budget.num_retries(15.0) == 1


# --- how the scheduler's Place spends it --------------------------------------------------------


class _Aborted(Exception):
    pass


class _Context:
    """The parts of a servicer context Place uses."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def time_remaining(self) -> float | None:
        return None

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> None:
        self.code, self.details = code, details
        raise _Aborted(details)


@pytest.fixture
async def scheduler(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[SchedulerService]:
    """A leading scheduler (no etcd) that knows one node, node-a, with the model warm."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(etcd="127.0.0.1:1"), Telemetry("scheduler/test", "none"))
    info = common_pb2.NodeInfo(node_id="node-a", address="127.0.0.1:1", gpu="h100", kv_block_size=16, models=[
        common_pb2.ModelInfo(name="m", max_context_tokens=4096, tokenizer="byte", vocab_size=257, is_warm=True,
                             state=common_pb2.MODEL_STATE_WARM, kv_blocks=10_000)])
    service._on_nodes_changed({etcd_keys.node_key("node-a"): json_format.MessageToJson(info).encode()})
    yield service
    await service.close()


def _move(exclude: list[str]) -> scheduler_pb2.PlaceRequest:
    return scheduler_pb2.PlaceRequest(request_id="r1", model="m", num_prompt_tokens=10, max_tokens=10,
                                      retry_cause="stalled", exclude_node_ids=exclude)


async def test_a_move_with_nowhere_to_go_spends_no_retry(scheduler: SchedulerService) -> None:
    """Issue 15.5: each move a one-node cluster could not make spent budget (twice, with the
    router's second ask); a move that places nothing now spends nothing."""
    context = _Context()
    with pytest.raises(_Aborted):
        await scheduler.Place(_move(["node-a"]), context)  # type: ignore[arg-type]
    assert scheduler._retry_budget.num_retries(time.monotonic()) == 0
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert "no live node has it warm" in context.details and "excluded: node-a" in context.details


async def test_a_move_that_is_placed_spends_one_retry(scheduler: SchedulerService) -> None:
    placement = await scheduler.Place(_move([]), _Context())  # type: ignore[arg-type]
    assert placement.node_id == "node-a"
    assert scheduler._retry_budget.num_retries(time.monotonic()) == 1


async def test_the_live_policy_learns_output_lengths_from_finished_notices(scheduler: SchedulerService) -> None:
    """The simulator's policy learns how long outputs run; the live one must too, from the routers'
    Finished notices (it is never told a request's length in advance)."""
    before = scheduler._policy.expected_output_tokens(_placement_request())
    for i in range(200):
        await scheduler.Finished(scheduler_pb2.FinishedRequest(
            request_id=f"done-{i}", model="m", num_output_tokens=3, outcome=scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED),
            _Context())
    assert scheduler._policy.expected_output_tokens(_placement_request()) < before / 10


def _placement_request() -> PlacementRequest:
    return PlacementRequest(request_id="r", model="m", num_prompt_tokens=10, num_prompt_blocks=0, max_tokens=2048)


async def test_a_move_over_the_budget_is_told_to_wait_for_the_window_and_one_no_wait_could_free_is_unavailable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The router waits out a move's RESOURCE_EXHAUSTED for as long as its hint says (test_router_stream): the hint is
    when the oldest retry leaves the window. A budget with no retry in it to leave frees nothing by waiting."""
    fake_leadership(monkeypatch, lambda: True)
    for reserve, code in ((0.1, grpc.StatusCode.RESOURCE_EXHAUSTED), (0.0, grpc.StatusCode.UNAVAILABLE)):
        service = SchedulerService(SchedulerConfig(etcd="127.0.0.1:1", retry_ratio=0.0, retry_min_per_s=reserve),
                                   Telemetry("scheduler/test", "none"))
        info = common_pb2.NodeInfo(node_id="node-a", address="127.0.0.1:1", gpu="h100", kv_block_size=16, models=[
            common_pb2.ModelInfo(name="m", max_context_tokens=4096, tokenizer="byte", vocab_size=257, is_warm=True,
                                 state=common_pb2.MODEL_STATE_WARM, kv_blocks=10_000)])
        service._on_nodes_changed({etcd_keys.node_key("node-a"): json_format.MessageToJson(info).encode()})
        try:
            if reserve:
                assert (await service.Place(_move([]), _Context())).node_id == "node-a"  # type: ignore[arg-type]
            context = _Context()
            with pytest.raises(_Aborted):
                await service.Place(_move([]), context)  # type: ignore[arg-type]
            assert context.code == code, context.details
            assert "cluster retry budget exhausted" in context.details
            assert ("retry after" in context.details) is bool(reserve)
        finally:
            await service.close()


async def test_the_streams_a_dead_node_last_reported_widen_the_budget_for_its_moves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """60 streams running on a node when it dies, none placed in the last 10 s: each needs one move, and 10 of 60
    were refused (helper-167). The leader counts the streams the nodes last reported."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(etcd="127.0.0.1:1", retry_ratio=0.2, retry_min_per_s=0.1),
                               Telemetry("scheduler/test", "none"))
    service._on_nodes_changed({etcd_keys.node_key(node_id): json_format.MessageToJson(common_pb2.NodeInfo(
        node_id=node_id, address="127.0.0.1:1", gpu="h100", kv_block_size=16, models=[common_pb2.ModelInfo(
            name="m", max_context_tokens=4096, tokenizer="byte", vocab_size=257, is_warm=True,
            state=common_pb2.MODEL_STATE_WARM, kv_blocks=100_000)])).encode() for node_id in ("node-a", "node-b")})
    service._cluster.report_load("node-a", Load(num_running=60, kv_blocks_total=100_000), time.monotonic())
    try:
        placed = 0
        for i in range(20):
            move = _move(["node-a"])
            move.request_id = f"r{i}"
            try:
                placed += (await service.Place(move, _Context())).node_id == "node-b"  # type: ignore[arg-type]
            except _Aborted:
                pass
        assert placed == 1 + 12  # the reserve (0.1/s over 10 s) and a fifth of the 60 in flight
    finally:
        await service.close()
