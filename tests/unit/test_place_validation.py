"""A Place whose fields make no sense is refused at once, by the field's name and value; the next is placed."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from baton.v1 import common_pb2, scheduler_pb2
from services.common.load import Load
from services.common.telemetry import Telemetry
from services.scheduler.config import SchedulerConfig
from services.scheduler.fleet import NodeSpec
from services.scheduler.servicer import SchedulerService
from tests.unit.leading import fake_leadership
from tests.unit.sim_profiles import sim_profiles
from tests.unit.test_place_during_election import FakeContext, Refused

MODEL = "m"
GOOD = {"request_id": "r", "model": MODEL, "num_prompt_tokens": 16, "max_tokens": 8}


@pytest.mark.parametrize(("fields", "named"), [
    ({"max_tokens": -5}, "max_tokens=-5"),
    ({"max_tokens": 0}, "max_tokens=0"),
    ({"num_prompt_tokens": 0}, "num_prompt_tokens=0"),
    ({"model": ""}, "model=''"),
    ({"context": common_pb2.RequestContext(tpot_budget_ms=-5)}, "tpot_budget_ms=-5"),
    ({"context": common_pb2.RequestContext(ttft_budget_ms=-1)}, "ttft_budget_ms=-1"),
    ({"context": common_pb2.RequestContext(deadline_ms=-2)}, "deadline_ms=-2"),
    ({"context": common_pb2.RequestContext(step=4, total_steps=3)}, "step=4"),
])
async def test_a_place_with_a_senseless_field_is_refused_by_name_and_the_next_is_placed(
        monkeypatch: pytest.MonkeyPatch, fields: dict, named: str) -> None:
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._role.elected.set()
    service._cluster.set_nodes([NodeSpec(node_id="n0", address="n0:1", gpu="h100", price_per_hour=1.0,
                                         warm_models=frozenset({MODEL}))])
    service._cluster.report_load("n0", Load(kv_blocks_total=1000), time.monotonic())
    try:
        with pytest.raises(Refused) as refused:
            await service.Place(scheduler_pb2.PlaceRequest(**{**GOOD, **fields}), FakeContext())  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert named in str(refused.value)
        placement = await service.Place(scheduler_pb2.PlaceRequest(**GOOD), FakeContext())  # type: ignore[arg-type]
        assert placement.node_id == "n0"
    finally:
        await service.close()


async def test_a_senseless_place_is_refused_at_once_even_while_no_leader_is_elected(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad input does not wait out an election (up to the call's deadline) to be refused."""
    fake_leadership(monkeypatch, lambda: False)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    try:
        with pytest.raises(Refused) as refused:
            await asyncio.wait_for(service.Place(scheduler_pb2.PlaceRequest(**{**GOOD, "max_tokens": -5}),
                                                 FakeContext()), 5)  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await service.close()


@pytest.mark.parametrize("limit", [-1, -100])
async def test_recent_decisions_with_a_negative_limit_are_refused_naming_it(limit: int) -> None:
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    try:
        with pytest.raises(Refused) as refused:
            await service.GetRecentDecisions(scheduler_pb2.GetRecentDecisionsRequest(limit=limit),
                                             FakeContext())  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"limit={limit}: must be 0" in str(refused.value)
    finally:
        await service.close()


async def test_a_place_whose_deadline_no_node_could_meet_is_invalid_unless_it_resumes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What no node serving the model could do is bad input (no retry hint); a stream its client resumes asks for
    what is left of its deadline, which only the fleet's load can refuse (with a hint)."""
    fake_leadership(monkeypatch, lambda: True)
    reader = InMemoryMetricReader()
    telemetry = Telemetry("scheduler/test", "none")
    telemetry.meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    service = SchedulerService(SchedulerConfig(), telemetry)
    service._role.elected.set()
    model = "sim-llama-3.1-8b"
    service._cluster.set_nodes([NodeSpec(node_id="n0", address="n0:1", gpu="h100", price_per_hour=1.0,
                                         warm_models=frozenset({model}), profiles=sim_profiles("h100", model))])
    service._cluster.report_load("n0", Load(kv_blocks_total=100_000), time.monotonic())
    hopeless = {**GOOD, "model": model, "max_tokens": 2000, "context": common_pb2.RequestContext(deadline_ms=5)}
    try:
        for resumed, code in ((False, grpc.StatusCode.INVALID_ARGUMENT), (True, grpc.StatusCode.RESOURCE_EXHAUSTED)):
            with pytest.raises(Refused) as refused:
                await service.Place(scheduler_pb2.PlaceRequest(**hopeless, resumed=resumed),
                                    FakeContext())  # type: ignore[arg-type]
            assert refused.value.code == code and "deadline_ms=5: cannot be met" in str(refused.value)
    finally:
        await service.close()
    # Both counted as admission refusals, as the gate's own are (they bypassed the gate's count).
    metrics = reader.get_metrics_data()
    assert sorted((p.attributes["reason"], p.value) for rm in metrics.resource_metrics for sm in rm.scope_metrics
                  for m in sm.metrics if m.name == "baton.scheduler.admissions" for p in m.data.data_points) == [
        ("deadline cannot be met", 1), ("deadline_ms no node could meet", 1)]
