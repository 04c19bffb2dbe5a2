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

# The router gives a Finished notice 2 s; the clock is seconds into its call.
CALL_S = 2.0


class RoutersCall:
    def __init__(self, clock: list[float], answered: list[tuple[float, grpc.StatusCode]]) -> None:
        self._clock, self._answered = clock, answered

    def time_remaining(self) -> float:
        return max(0.0, CALL_S - self._clock[0])

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> None:
        self._answered.append((self._clock[0], code))
        raise Refused(code, details)


@pytest.mark.parametrize(("confirmed_at", "counted"), [
    (1.2, True),  # a keep-alive late by more than a second, within the call: the notice is counted
    (None, False),  # never (etcd unreachable): refused while the router still listens, not past its deadline
])
async def test_a_leader_whose_lease_is_unconfirmed_answers_within_the_routers_time(
        monkeypatch: pytest.MonkeyPatch, confirmed_at: float | None, counted: bool) -> None:
    # Holding the notice the router's whole 2 s, a refusal came past its deadline: the router heard
    # DEADLINE_EXCEEDED, naming no leader, and the notice was lost.
    clock = [0.0]
    answered: list[tuple[float, grpc.StatusCode]] = []

    async def wait_confirmed(self: LeaderRole, timeout_s: float) -> bool:
        clock[0] += timeout_s if confirmed_at is None else min(timeout_s, max(0.0, confirmed_at - clock[0]))
        return confirmed_at is not None and clock[0] >= confirmed_at

    async def successor_never_shown(self: LeaderRole, timeout_s: float) -> None:
        clock[0] += timeout_s

    fake_leadership(monkeypatch, lambda: False)
    monkeypatch.setattr(LeaderRole, "wait_confirmed", wait_confirmed)
    monkeypatch.setattr(LeaderRole, "wait_successor_shown", successor_never_shown)
    monkeypatch.setattr(LeaderRole, "leader", lambda self: ("scheduler-0", "127.0.0.1:8"))  # itself, as etcd showed
    service = SchedulerService(SchedulerConfig(instance_id="scheduler-0"), Telemetry("scheduler/test", "none"))
    service._role.elected.set()  # it took over long ago
    try:
        notice = scheduler_pb2.FinishedRequest(request_id="r1", outcome=scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED)
        try:
            await service.Finished(notice, RoutersCall(clock, answered))  # type: ignore[arg-type]
        except Refused:
            pass
    finally:
        await service.close()
    assert service._tasks.stats().succeeded == (1 if counted else 0)
    if not counted:
        [(at, code)] = answered
        assert at < CALL_S and code == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_deposed_leader_names_its_successor_within_the_routers_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its lease lost while etcd was slow to say so: it holds the notice for a refresh that never comes, and must
    # still leave time for etcd to show the successor, or the refusal names no one and the notice is lost.
    clock = [0.0]
    shown = [False]
    answered: list[tuple[float, grpc.StatusCode]] = []
    hints: list[object] = []

    async def never_confirmed(self: LeaderRole, timeout_s: float) -> bool:
        clock[0] += timeout_s
        return False

    async def successor_shown_after(self: LeaderRole, timeout_s: float) -> None:
        clock[0] += min(timeout_s, 0.3)
        shown[0] = timeout_s >= 0.3

    class NamingCall(RoutersCall):
        async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> None:
            hints.append(dict(trailing_metadata).get(LEADER_KEY))  # type: ignore[call-overload]
            await super().abort(code, details)

    fake_leadership(monkeypatch, lambda: False)
    monkeypatch.setattr(LeaderRole, "wait_confirmed", never_confirmed)
    monkeypatch.setattr(LeaderRole, "wait_successor_shown", successor_shown_after)
    monkeypatch.setattr(LeaderRole, "leader",
                        lambda self: ("scheduler-1", "127.0.0.1:9") if shown[0] else ("scheduler-0", "127.0.0.1:8"))
    service = SchedulerService(SchedulerConfig(instance_id="scheduler-0"), Telemetry("scheduler/test", "none"))
    try:
        notice = scheduler_pb2.FinishedRequest(request_id="r1", outcome=scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED)
        with pytest.raises(Refused):
            await service.Finished(notice, NamingCall(clock, answered))  # type: ignore[arg-type]
    finally:
        await service.close()
    [(at, code)] = answered
    assert at < CALL_S and code == grpc.StatusCode.FAILED_PRECONDITION and hints == ["127.0.0.1:9"]
    assert service._tasks.stats().succeeded == 0
