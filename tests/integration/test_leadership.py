"""Exact leadership: one scheduler places at a time, through a frozen leader and a leader re-elected in place."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from baton.client import BatonClient
from baton.cluster import ClusterSpec, LocalCluster, ManagedProcess
from baton.protocol import LEADER_KEY
from baton.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.integration.conftest import MODEL, eventually
from tests.integration.test_control_plane import SteadyLoad

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TTL_S = 2


def state_of(process: ManagedProcess) -> scheduler_pb2.ClusterState:
    with grpc.insecure_channel(process.address) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).GetClusterState(
            scheduler_pb2.GetClusterStateRequest(), timeout=2)


def decisions_of(process: ManagedProcess) -> list[scheduler_pb2.PlacementDecision]:
    with grpc.insecure_channel(process.address) as channel:
        return list(scheduler_pb2_grpc.SchedulerStub(channel).GetRecentDecisions(
            scheduler_pb2.GetRecentDecisionsRequest(), timeout=2).decisions)


@pytest.fixture
def two_schedulers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_nodes=3, speed=10.0, lease_ttl_s=TTL_S, num_schedulers=2, num_routers=2)
    with LocalCluster(spec, tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


async def test_a_frozen_leader_is_replaced_without_two_schedulers_ever_placing_at_once(
    two_schedulers: LocalCluster,
) -> None:
    cluster = two_schedulers
    load = SteadyLoad(cluster)
    load.start()
    try:
        await load.wait_completed(10)
        old = next(p for p in cluster.schedulers if state_of(p).leading_revision)
        standby = next(p for p in cluster.schedulers if p is not old)
        old_revision = state_of(old).leading_revision
        async with grpc.aio.insecure_channel(old.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            await stub.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=2)  # connected

            old.signal(signal.SIGSTOP)  # frozen for longer than its lease: it can neither place nor refresh
            frozen_at_ms = int(time.time() * 1000)
            # Placements that reach the old leader while it is frozen, answered once it resumes.
            queued = asyncio.gather(*(stub.Place(scheduler_pb2.PlaceRequest(
                request_id=f"queued-at-the-frozen-leader-{i}", model=MODEL, num_prompt_tokens=8, max_tokens=8),
                timeout=30) for i in range(5)), return_exceptions=True)
            try:
                await eventually(lambda: state_of(standby).leading_revision > old_revision, 5 * TTL_S,
                                 "the standby to lead")
                await load.wait_completed(10)  # placements move to the new leader, not waiting out the frozen one
            finally:
                old.signal(signal.SIGCONT)
            answers = await queued
        # Refused, with a redirect to the successor: never placed by a replica that lost its lease.
        assert all(isinstance(a, grpc.aio.AioRpcError) for a in answers), f"placed after losing the lease: {answers}"
        assert {(a.code(), dict(a.trailing_metadata() or ()).get(LEADER_KEY)) for a in answers} == {
            (grpc.StatusCode.FAILED_PRECONDITION, standby.address)}, [a.details() for a in answers]
        # Back, the old leader learns it lost, and answers as a standby.
        await eventually(lambda: state_of(old).leader_id == standby.name, 5 * TTL_S,
                         "the old leader to see its successor")
        assert state_of(old).leading_revision == 0 and not state_of(old).HasField("tasks")
        await load.wait_completed(10)
    finally:
        await load.stop()
    assert load.failures == []

    old_decisions, new_decisions = decisions_of(old), decisions_of(standby)
    assert {d.leader_revision for d in old_decisions} == {old_revision}
    assert {d.leader_revision for d in new_decisions} == {state_of(standby).leading_revision}
    # Nothing placed by the old leader once frozen (not even the calls queued at it while it was),
    # and the new leader's first placement came after the old one's last.
    assert max(d.decided_at_ms for d in old_decisions) <= frozen_at_ms
    assert min(d.decided_at_ms for d in new_decisions) >= max(d.decided_at_ms for d in old_decisions)


@pytest.fixture
def one_scheduler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_nodes=2, speed=10.0, lease_ttl_s=TTL_S)
    with LocalCluster(spec, tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


async def test_a_leader_re_elected_at_the_same_address_is_called_again(one_scheduler: LocalCluster) -> None:
    cluster = one_scheduler
    scheduler, router = cluster.schedulers[0], cluster.routers[0]
    async with BatonClient(router.address) as client:
        await client.complete(MODEL, "before the restart", max_tokens=4)
        scheduler.signal(signal.SIGKILL)  # its election key stays until its lease ends
        request = asyncio.create_task(
            client.complete(MODEL, "during the restart", max_tokens=8, ignore_eos=True, timeout_s=30))
        await eventually(lambda: "waiting for a leader" in router.log_tail(50), 10,
                         "the router to find the leader gone")
        cluster.restart(scheduler)  # the same address, a new election key and revision
        result = await request
    assert result.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(result.token_ids) == 8
