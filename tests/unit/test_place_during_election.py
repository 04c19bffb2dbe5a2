"""A Place that reaches the scheduler while etcd shows no leader waits for the election."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from google.protobuf import json_format

from baton.v1 import common_pb2, scheduler_pb2
from services.common import etcd_keys
from services.common.load import Load
from services.common.telemetry import Telemetry
from services.scheduler.config import SchedulerConfig
from services.scheduler.fleet import NodeSpec
from services.scheduler.servicer import SchedulerService
from tests.unit.leading import fake_leadership

MODEL = "m"


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


class FakeContext:
    """The part of a servicer context that Place uses."""

    def time_remaining(self) -> float:
        return 30.0

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> None:
        raise Refused(code, details)


async def test_a_place_while_the_leader_is_being_re_elected_is_placed_not_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # As after an etcd freeze: the leader's election key lapsed, it stepped down and campaigns again.
    leading = asyncio.Event()
    fake_leadership(monkeypatch, leading.is_set)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._cluster.set_nodes([NodeSpec(node_id="n0", address="n0:1", gpu="h100", price_per_hour=1.0,
                                         warm_models=frozenset({MODEL}))])
    service._cluster.report_load("n0", Load(kv_blocks_total=1000), time.monotonic())
    request = scheduler_pb2.PlaceRequest(request_id="r1", model=MODEL, num_prompt_tokens=16, max_tokens=8)
    try:
        placing = asyncio.create_task(service.Place(request, FakeContext()))  # type: ignore[arg-type]
        await asyncio.sleep(0)  # one turn of the loop: Place runs until it waits, or is refused
        assert not placing.done(), "refused while the election was under way"
        leading.set()
        service._role.elected.set()
        placement = await asyncio.wait_for(placing, 5)
        assert placement.node_id == "n0"
    finally:
        await service.close()


@pytest.mark.parametrize(("silent", "reports_again"), [(False, False), (True, False), (True, True)])
async def test_a_place_whose_exclusions_leave_only_a_busy_gpu_with_the_model_on_disk_is_refused_at_once(
        monkeypatch: pytest.MonkeyPatch, silent: bool, reports_again: bool) -> None:
    """The model is warm on n0, which the router avoids, and on n1's disk, whose GPU serves another model: no load
    is coming for it (warm capacity is not short), yet Place waited for the planner until the caller's deadline, and
    the router had no time left to ask again without its exclusions (a live probe saw a request hang 45 s)."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._cluster.set_nodes([
        NodeSpec(node_id="n0", address="n0:1", gpu="h100", price_per_hour=1.0, warm_models=frozenset({MODEL})),
        NodeSpec(node_id="n1", address="n1:1", gpu="h100", price_per_hour=1.0, warm_models=frozenset({"other"}),
                 cold_models=frozenset({MODEL}))])
    service._cluster.report_load("n1", Load(kv_blocks_total=1000), time.monotonic())
    # n0 reported just now; or 5 s ago, when it may have died: then the request waits, as before, for n0's lease to
    # end and the planner to load the model on n1 (here it waits on).
    service._cluster.report_load("n0", Load(kv_blocks_total=1000), time.monotonic() - (5.0 if silent else 0.0))
    service._role.elected.set()
    request = scheduler_pb2.PlaceRequest(request_id="r1", model=MODEL, num_prompt_tokens=16, max_tokens=8,
                                         exclude_node_ids=["n0"])
    if reports_again:  # late, not dead: its next report comes while the request waits, and it is refused then
        asyncio.get_running_loop().call_later(
            0.3, lambda: service._cluster.report_load("n0", Load(kv_blocks_total=1000), time.monotonic()))
    try:
        if silent and not reports_again:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(service.Place(request, FakeContext()), 0.5)  # type: ignore[arg-type]
            return
        with pytest.raises(Refused) as refused:
            await asyncio.wait_for(service.Place(request, FakeContext()), 5)  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE and "excluded: n0" in str(refused.value)
    finally:
        await service.close()


async def test_a_standby_does_not_end_the_tasks_no_one_reports_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """No live report touches a standby's tasks, so its timeout ended them as failed; a leader elected again after an
    etcd freeze keeps its own ledger, so those would stay failed. Only the leader ends silent tasks."""
    leading = False
    fake_leadership(monkeypatch, lambda: leading)
    service = SchedulerService(SchedulerConfig(model_plan_interval_s=0.01, task_timeout_s=0.01),
                               Telemetry("scheduler/test", "none"))
    service._tasks.record("step-1-of-2", 1, 2, 0.0, ok=True, now=service._clock() - 1.0)
    ticks = 0

    def tick() -> None:
        nonlocal ticks
        ticks += 1

    monkeypatch.setattr(service._planner, "release", tick)  # called on each of a standby's planning rounds
    planning = asyncio.create_task(service._plan_models())
    try:
        while ticks < 3:
            await asyncio.sleep(0.01)  # the planning rounds' own pace, counted by tick
        assert service._tasks.stats().open == 1
        leading = True
        while service._tasks.stats().open:
            await asyncio.sleep(0.01)
        assert service._tasks.stats().failed == 1  # the leader ends it: silent past the timeout, step 2 never came
    finally:
        planning.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await planning
        await service.close()


@pytest.mark.parametrize("max_tokens", [8, 8000])
async def test_a_place_that_reaches_a_leader_before_it_has_read_the_nodes_waits_for_them(
        monkeypatch: pytest.MonkeyPatch, max_tokens: int) -> None:
    """A leader elected before its first listing of the nodes came from etcd refused every model NOT_FOUND, "no
    registered node has it", a code a router passes on and a client does not retry. It waits for the listing, and
    then holds the request to the model's context, which comes with it (helper-139: checked before the wait, a
    request past it was placed)."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._role.elected.set()
    request = scheduler_pb2.PlaceRequest(request_id="r1", model=MODEL, num_prompt_tokens=16, max_tokens=max_tokens)
    info = common_pb2.NodeInfo(node_id="n0", address="n0:1", gpu="h100", price_per_hour=1.0,
                               models=[common_pb2.ModelInfo(name=MODEL, max_context_tokens=4096, is_warm=True)])
    try:
        placing = asyncio.create_task(service.Place(request, FakeContext()))  # type: ignore[arg-type]
        await asyncio.sleep(0)  # one turn of the loop: Place runs until it waits, or is refused
        assert not placing.done(), "refused before the nodes were read"
        service._on_nodes_changed({etcd_keys.node_key("n0"): json_format.MessageToJson(info).encode()})
        service._cluster.report_load("n0", Load(kv_blocks_total=1000), time.monotonic())
        if max_tokens > 4096:
            with pytest.raises(Refused) as refused:
                await asyncio.wait_for(placing, 5)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in str(refused.value)
        else:
            placement = await asyncio.wait_for(placing, 5)
            assert placement.node_id == "n0"
    finally:
        await service.close()


async def test_a_leader_that_cannot_read_the_nodes_refuses_unavailable_within_the_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._role.elected.set()
    context = FakeContext()
    context.time_remaining = lambda: 0.3  # type: ignore[method-assign]
    request = scheduler_pb2.PlaceRequest(request_id="r1", model=MODEL, num_prompt_tokens=16, max_tokens=8)
    try:
        with pytest.raises(Refused) as refused:
            await asyncio.wait_for(service.Place(request, context), 5)  # type: ignore[arg-type]
    finally:
        await service.close()
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert "has not read the nodes from etcd" in str(refused.value)
