"""The router's search for the scheduler leader through a failover (Relay._call_scheduler)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from baton.protocol import LEADER_KEY
from baton.v1 import common_pb2, router_pb2, scheduler_pb2
from services.common.directory import LeaderRecord
from services.common.errors import Unavailable
from services.common.telemetry import Telemetry
from services.router.config import RouterConfig
from services.router.generation import Generation
from services.router.relay import MOVE_ASK_EVERY_S, Ending, Relay, move_wait_s

pytestmark = pytest.mark.timeout(10)

OLD = LeaderRecord("/baton/election/scheduler/old", 3, "scheduler-old:1")
NEW = LeaderRecord("/baton/election/scheduler/new", 5, "scheduler-new:1")


class ElectionAsEtcdShowsIt:
    """A LeaderDirectory whose etcd view shows one leader throughout: waiting for another times out."""

    def __init__(self, shown: LeaderRecord) -> None:
        self.shown = shown
        self._never = asyncio.Event()

    def leader(self) -> LeaderRecord:
        return self.shown

    async def wait_for_other(self, leader: LeaderRecord | None, timeout_s: float) -> LeaderRecord | None:
        if self.shown != leader:
            return self.shown
        try:
            await asyncio.wait_for(self._never.wait(), timeout_s)
        except TimeoutError:
            pass
        return None

    async def wait_other_or_reachable(self, leader: LeaderRecord, timeout_s: float) -> LeaderRecord | None:
        return await self.wait_for_other(leader, timeout_s)


def _relay(leader_wait_s: float, directory: object) -> Relay:
    """A relay that sees the leader as directory shows it, with no node channels."""
    return Relay(RouterConfig(leader_wait_s=leader_wait_s), directory,  # type: ignore[arg-type]
                 None, None, Telemetry("router/test", "none").meter, lambda _: None)  # type: ignore[arg-type]


def _error(code: grpc.StatusCode, details: str, *trailing: tuple[str, str]) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


async def test_a_stale_hint_from_the_new_leader_does_not_make_the_router_wait_it_out() -> None:
    """Seen in the compose failover test: the new leader, a few ms before its own view showed its election,
    answered as a standby naming the dead old leader; the call there failed in transport, and the router
    then waited for a leader other than the new one — which never came — until --leader-wait-s ran out."""
    relay = _relay(5.0, ElectionAsEtcdShowsIt(NEW))
    calls: list[str] = []

    async def place_at(address: str, is_current: object, place: object, timeout_s: float) -> scheduler_pb2.Placement:
        calls.append(address)
        if len(calls) == 1:  # the new leader, before it sees its own election
            raise _error(grpc.StatusCode.FAILED_PRECONDITION, "scheduler-new is a standby; the leader is old",
                         (LEADER_KEY, OLD.address))
        if address == OLD.address:  # killed: the connection fails
            raise _error(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        return scheduler_pb2.Placement(node_id="n0")

    relay._call_at = place_at  # type: ignore[method-assign]
    placement = await relay._call_scheduler(scheduler_pb2.PlaceRequest(request_id="r"), remaining_s=30.0)
    assert placement.node_id == "n0"
    assert calls == [NEW.address, OLD.address, NEW.address]


@pytest.mark.parametrize(("leader_wait_s", "remaining_s", "waited"), [(0.2, 30.0, "0.2"), (30.0, 0.3, "0.3")])
async def test_with_no_leader_answering_the_router_gives_up_after_the_wait_the_request_had(
        leader_wait_s: float, remaining_s: float, waited: str) -> None:
    # --leader-wait-s, or the request's own time when that ends first: the message said --leader-wait-s regardless.
    relay = _relay(leader_wait_s, ElectionAsEtcdShowsIt(NEW))

    async def place_at(address: str, is_current: object, place: object, timeout_s: float) -> scheduler_pb2.Placement:
        raise _error(grpc.StatusCode.UNAVAILABLE, "Socket closed")

    relay._call_at = place_at  # type: ignore[method-assign]
    with pytest.raises(Unavailable, match=rf"no scheduler leader took the placement within {waited} s of the first"):
        await relay._call_scheduler(scheduler_pb2.PlaceRequest(request_id="r"), remaining_s=remaining_s)


class NoneElected(ElectionAsEtcdShowsIt):
    """etcd shows no leader at all, throughout."""

    def leader(self) -> None:  # type: ignore[override]
        return None

    async def wait_for_other(self, leader: LeaderRecord | None, timeout_s: float) -> LeaderRecord | None:
        await asyncio.sleep(timeout_s)
        return None


async def test_with_no_leader_elected_the_refusal_says_so() -> None:
    relay = _relay(0.2, NoneElected(OLD))
    with pytest.raises(Unavailable, match=r"no scheduler leader is elected: etcd showed none for 0\.2 s"):
        await relay._call_scheduler(scheduler_pb2.PlaceRequest(request_id="r"), remaining_s=30.0)


class LeaderKilled(ElectionAsEtcdShowsIt):
    """etcd shows OLD until a call to it fails, then NEW (OLD's lease lapsed, the standby won the election)."""

    def __init__(self) -> None:
        super().__init__(OLD)

    def address(self) -> str:
        return self.shown.address

    async def wait_other_or_reachable(self, leader: LeaderRecord, timeout_s: float) -> LeaderRecord | None:
        self.shown = NEW
        return NEW


async def test_a_finished_notice_sent_to_a_leader_that_just_died_reaches_the_next_one() -> None:
    # Before, it was sent once: the successes of the requests that ended as their leader failed were never
    # counted (3 of 3 lost per failover in a live probe), nor their GPU time charged.
    relay = _relay(5.0, LeaderKilled())
    told: list[tuple[str, str]] = []

    async def call_at(address: str, is_current: object, request: object, timeout_s: float) -> object:
        assert isinstance(request, scheduler_pb2.FinishedRequest)
        if address == OLD.address:
            raise _error(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        told.append((address, request.request_id))
        return scheduler_pb2.FinishedAck()

    relay._call_at = call_at  # type: ignore[method-assign]
    generation = Generation(request_id="r1", model="m", prompt_token_ids=[1], sampling=common_pb2.SamplingParams())
    relay.tell_finished(Ending(generation, router_pb2.GenerateRequest(), 5, scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED))
    await relay.close()  # waits for the notices under way
    assert told == [(NEW.address, "r1")]


async def test_with_no_leader_answering_a_router_avoiding_a_node_waits_once_not_twice() -> None:
    # With a node suspect, an UNAVAILABLE placement is asked again without it (every node avoided may be all there
    # is): after a leader wait that ran out, that waited as long again for the same leader.
    relay = _relay(0.2, ElectionAsEtcdShowsIt(NEW))
    calls: list[list[str]] = []

    async def place_at(address: str, is_current: object, place: scheduler_pb2.PlaceRequest,
                       timeout_s: float) -> scheduler_pb2.Placement:
        calls.append(list(place.exclude_node_ids))
        raise _error(grpc.StatusCode.UNAVAILABLE, "Socket closed")

    relay._call_at = place_at  # type: ignore[method-assign]
    relay._suspects["n-suspect"] = asyncio.get_running_loop().time() + 60
    generation = Generation(request_id="r", model="m", prompt_token_ids=[1], sampling=common_pb2.SamplingParams())
    with pytest.raises(Unavailable, match="no scheduler leader took the placement within 0.2 s"):
        await relay._place(generation, router_pb2.GenerateRequest(), None, lambda: 30.0)
    assert calls and all(excluded == ["n-suspect"] for excluded in calls), calls


async def test_a_placement_the_live_leader_held_to_the_calls_end_is_refused_without_waiting_for_another() -> None:
    """The leader etcd still shows held the placement until the call timed out (queued on a saturated fleet, or
    waiting for a model load): it is alive, so no other leader will take over. The router waited --leader-wait-s
    (30 s) more for one, then blamed the leader (helper-126)."""
    relay = _relay(30.0, ElectionAsEtcdShowsIt(NEW))

    async def place_at(address: str, is_current: object, place: object, timeout_s: float) -> scheduler_pb2.Placement:
        raise _error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    relay._call_at = place_at  # type: ignore[method-assign]
    with pytest.raises(Unavailable) as refused:
        await asyncio.wait_for(relay._call_scheduler(scheduler_pb2.PlaceRequest(request_id="r"), remaining_s=None),
                               5)
    assert str(refused.value) == (f"scheduler {NEW.address} did not take the placement within 60.0 s (admission "
                                  "queueing or a model load); etcd still shows it leading, so no other leader would "
                                  "take it")


def test_the_moves_a_spent_retry_budget_holds_back_ask_again_spread_out_not_together() -> None:
    """Every move of a dead node's streams got the same hint, woke together, and all but one were held back again a
    millisecond later: 300 moves asked the leader 11,774 times (helper-168). Each waits at least MOVE_ASK_EVERY_S
    and the hint, plus a share of a tenth of that drawn at random."""
    waits = [move_wait_s(1, i / 300) for i in range(300)]
    assert min(waits) == MOVE_ASK_EVERY_S and max(waits) < 2.2 * MOVE_ASK_EVERY_S
    assert len({round(w, 3) for w in waits}) > 100  # spread over the range, not bunched
    assert 10.0 <= move_wait_s(10_000, 0.0) < move_wait_s(10_000, 0.99) < 11.3
