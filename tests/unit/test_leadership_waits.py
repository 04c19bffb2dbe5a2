"""A scheduler's waits for its own leadership leave the caller time to hear the answer."""

from __future__ import annotations

import grpc
import pytest

from baton.protocol import LEADER_KEY
from baton.v1 import scheduler_pb2
from services.common.telemetry import Telemetry
from services.scheduler.config import SchedulerConfig
from services.scheduler.leadership import LeaderRole
from services.scheduler.servicer import SchedulerService
from tests.unit.leading import fake_leadership
from tests.unit.test_place_during_election import Refused

SUCCESSOR = ("scheduler-1", "127.0.0.1:9")


async def test_a_deposed_leader_names_its_successor_within_the_routers_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its lease lost while etcd was slow to say so: it held the notice for a refresh that never came, then waited
    # for the successor to show. Holding it the router's whole 2 s, the refusal came past the router's deadline, the
    # router heard DEADLINE_EXCEEDED with no leader named, and the notice was lost.
    clock = [0.0]  # seconds into the router's call; its deadline at 2.0
    shown = [False]

    async def never_confirmed(self: LeaderRole, timeout_s: float) -> bool:
        clock[0] += timeout_s
        return False

    async def successor_shown_after(self: LeaderRole, timeout_s: float) -> None:
        clock[0] += min(timeout_s, 0.5)
        shown[0] = timeout_s >= 0.5

    fake_leadership(monkeypatch, lambda: False)
    monkeypatch.setattr(LeaderRole, "wait_confirmed", never_confirmed)
    monkeypatch.setattr(LeaderRole, "wait_successor_shown", successor_shown_after)
    monkeypatch.setattr(LeaderRole, "leader", lambda self: SUCCESSOR if shown[0] else ("scheduler-0", "127.0.0.1:8"))
    answered: list[tuple[float, object]] = []

    class RoutersCall:
        def time_remaining(self) -> float:
            return max(0.0, 2.0 - clock[0])

        async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> None:
            answered.append((clock[0], dict(trailing_metadata).get(LEADER_KEY)))  # type: ignore[call-overload]
            raise Refused(code, details)

    service = SchedulerService(SchedulerConfig(instance_id="scheduler-0"), Telemetry("scheduler/test", "none"))
    try:
        notice = scheduler_pb2.FinishedRequest(request_id="r1", outcome=scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED)
        with pytest.raises(Refused) as refused:
            await service.Finished(notice, RoutersCall())  # type: ignore[arg-type]
    finally:
        await service.close()
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    [(at, hint)] = answered
    assert at < 2.0 and hint == SUCCESSOR[1]
    assert service._tasks.stats().succeeded == 0
