"""A resume goes back to the node its id was placed on: it takes the place of the stream still running there."""

from __future__ import annotations

import time

import pytest

from baton.v1 import scheduler_pb2
from services.common.load import Load
from services.common.telemetry import Telemetry
from services.scheduler.config import SchedulerConfig
from services.scheduler.fleet import NodeSpec
from services.scheduler.servicer import SchedulerService
from tests.unit.leading import fake_leadership
from tests.unit.test_place_during_election import FakeContext

pytestmark = pytest.mark.timeout(20)

MODEL = "m"
IDLE = Load(kv_blocks_total=1000)
BUSY = Load(num_running=12, kv_blocks_used=300, kv_blocks_total=1000, active_decode_blocks=300)


def _place(request_id: str, router_id: str, resumed: bool = False,
           exclude: tuple[str, ...] = ()) -> scheduler_pb2.PlaceRequest:
    return scheduler_pb2.PlaceRequest(request_id=request_id, model=MODEL, num_prompt_tokens=64, max_tokens=512,
                                      router_id=router_id, resumed=resumed, prompt_digest=7,
                                      exclude_node_ids=list(exclude))


@pytest.mark.parametrize("excluded", [False, True])
async def test_a_resume_is_placed_on_the_node_still_running_its_stream(
        monkeypatch: pytest.MonkeyPatch, excluded: bool) -> None:
    """Its first router frozen, a client resumed through another: the leader placed the resume by its policy, on
    the idle node, and both streams ran there and on the busy one until the node dropped the frozen router (helper-114
    saw it 4 times in 4). It now goes back to its node, which takes the running stream's place. One that node
    refused (its router then excludes the node) is placed by the policy, as a fresh request is."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._role.elected.set()
    service._cluster.set_nodes([NodeSpec(node_id=n, address=f"{n}:1", gpu="h100", price_per_hour=1.0,
                                         warm_models=frozenset({MODEL})) for n in ("n0", "n1")])
    try:
        for node_id in ("n0", "n1"):
            service._cluster.report_load(node_id, IDLE, time.monotonic())
        first = await service.Place(_place("r1", "router-a"), FakeContext())  # type: ignore[arg-type]
        other = "n1" if first.node_id == "n0" else "n0"
        # The first node now busy, the other idle: the policy sends new work to the other.
        service._cluster.report_load(first.node_id, BUSY, time.monotonic())
        service._cluster.report_load(other, IDLE, time.monotonic())
        fresh = await service.Place(_place("r2", "router-b"), FakeContext())  # type: ignore[arg-type]
        assert fresh.node_id == other
        exclude = (first.node_id,) if excluded else ()
        resume = await service.Place(_place("r1", "router-b", resumed=True, exclude=exclude),
                                     FakeContext())  # type: ignore[arg-type]
        assert resume.node_id == (other if excluded else first.node_id)
    finally:
        await service.close()
