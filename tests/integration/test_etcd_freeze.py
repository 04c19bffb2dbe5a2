"""An etcd that freezes for longer than the lease TTL fails no request, before, during or after;
views of etcd hold keys whose lease lapsed for a grace period, and drop those given up at once."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.client import BatonClient
from baton.cluster import ClusterSpec, LocalCluster, ManagedProcess
from baton.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common import etcd_keys
from services.common.etcd_session import LeaseSession, PrefixView, connect
from tests.integration.conftest import MODEL, eventually
from tests.integration.load import SteadyLoad

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

TTL_S = 3
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
FREEZE_S = 3 * TTL_S
NUM_TOKENS = 60


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three real-time nodes with 2 s leases, one scheduler, one router."""
    spec = ClusterSpec(num_nodes=3, speed=1.0, lease_ttl_s=TTL_S)
    with LocalCluster(spec, tmp_path_factory.mktemp("cluster")) as started:
        yield started


async def node_leases(endpoint: str) -> dict[str, int]:
    """Each registered node's lease, as etcd holds it now."""
    client = connect(endpoint)
    try:
        listing = await client.get_prefix(etcd_keys.NODES.encode())
    finally:
        await client.close()
    return {kv.key.decode().removeprefix(etcd_keys.NODES): kv.lease for kv in listing}


async def listed_nodes(address: str, stop: asyncio.Event) -> list[int]:
    """How many nodes the scheduler lists, asked back to back until stop is set."""
    counts = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        while not stop.is_set():
            state = await stub.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=5)
            counts.append(len(state.nodes))
    return counts


def leader_health(process: ManagedProcess) -> int:
    """What the scheduler's gRPC health says of baton.v1.Scheduler."""
    with grpc.insecure_channel(process.address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="baton.v1.Scheduler"),
                                                         timeout=2).status


async def test_an_etcd_freeze_longer_than_the_ttl_fails_no_request(cluster: LocalCluster) -> None:
    assert cluster.etcd is not None and cluster.router is not None and cluster.scheduler is not None
    leases_before = await node_leases(cluster.etcd.address)
    load = SteadyLoad([cluster.router.address], num_tokens=NUM_TOKENS, forbid_migrations=True)
    load.start()
    await load.wait_completed(5)
    stop_asking = asyncio.Event()
    asking = asyncio.create_task(listed_nodes(cluster.scheduler.address, stop_asking))

    loop = asyncio.get_running_loop()
    frozen_at = loop.time()
    cluster.etcd.signal(signal.SIGSTOP)
    try:
        # Streams already placed go on; new placements wait, since no leader can confirm its lease
        # (docs/etcd.md), and the leader says so on gRPC health (it said SERVING throughout, helper-207).
        await eventually(lambda: leader_health(cluster.scheduler) == NOT_SERVING, FREEZE_S,
                         "the leader, its lease unconfirmed, to stop serving baton.v1.Scheduler")
        # The rest of the fault's length, not synchronisation.
        await asyncio.sleep(max(0.0, FREEZE_S - (loop.time() - frozen_at)))
    finally:
        cluster.etcd.signal(signal.SIGCONT)
    await eventually(lambda: leader_health(cluster.scheduler) == SERVING, 10,
                     "the leader to serve baton.v1.Scheduler again once etcd thawed")

    async def every_node_re_registered() -> bool:
        # Every lease expired while etcd was frozen: each node is back under a lease of its own.
        leases = await node_leases(cluster.etcd.address)
        return leases.keys() == leases_before.keys() and all(
            leases[node] != leases_before[node] for node in leases)

    await eventually(every_node_re_registered, 10, "every node to register again under a new lease")
    await load.wait_completed(3 * len(cluster.nodes))
    await load.stop()
    stop_asking.set()
    assert load.failures == [], "\n".join(load.failures)
    counts = await asking
    assert counts and min(counts) == len(cluster.nodes), "the scheduler dropped a live node for a moment"

    state = cluster.cluster_state()
    assert sorted(n.info.node_id for n in state.nodes) == ["node-0", "node-1", "node-2"]

    async def every_ending_counted() -> bool:
        # The leader, elected again once etcd thawed, restored the state it had written before the freeze over the
        # ledger it kept: the endings it was told of after that write were lost. (A request that ended late is a
        # task left open, for the task timeout, to a retry under its id.)
        tasks = cluster.cluster_state().tasks
        return tasks.tasks_succeeded + tasks.tasks_failed + tasks.tasks_open == load.num_completed

    await eventually(every_ending_counted, 10, "the leader's ledger to count every request that ended")
    async with BatonClient(cluster.router.address) as client:
        models = await client.list_models()
    assert [(m.name, m.num_warm_nodes) for m in models] == [(MODEL, 3)]


PREFIX = "/test/view/"
KEY = f"{PREFIX}holder"


class RecordedView:
    """A PrefixView with a grace period, and every view it showed, with what was lapsed in it."""

    def __init__(self, endpoint: str, grace_s: float) -> None:
        self.client = connect(endpoint)
        self.views: list[tuple[set[str], frozenset[str]]] = []
        self.view = PrefixView(self.client, PREFIX, self._record, grace_s=grace_s)
        self._task: asyncio.Task[None] | None = None

    def _record(self, items: dict[str, bytes]) -> None:
        self.views.append((set(items), self.view.lapsed))

    async def __aenter__(self) -> RecordedView:
        self._task = asyncio.create_task(self.view.run())
        await asyncio.wait_for(self.view.wait_for(lambda items: KEY in items), 5)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self.client.close()

    def was_lapsed(self) -> bool:
        return any(KEY in lapsed for _, lapsed in self.views)


async def test_a_key_whose_lease_lapsed_stays_in_view_while_its_holder_puts_it_back(etcd: ManagedProcess) -> None:
    holder = connect(etcd.address)
    session = LeaseSession(holder, ttl_s=TTL_S)
    await session.put(KEY, b"alive")
    keep_alive = asyncio.create_task(session.keep_alive())
    try:
        async with RecordedView(etcd.address, grace_s=TTL_S) as recorded:
            lapsed_lease = session.lease_id
            assert lapsed_lease is not None
            await recorded.client.revoke_lease(lapsed_lease)  # as a frozen etcd does on resuming

            async def put_back() -> bool:
                stored = await recorded.client.get(KEY.encode())
                return stored is not None and stored.lease != lapsed_lease

            await eventually(put_back, 10, "the holder to put its key back under a new lease")
            await asyncio.wait_for(recorded.view.wait_for(lambda _: not recorded.view.lapsed), 5)
            assert recorded.was_lapsed(), "the key vanished from etcd for a moment"
            assert all(KEY in items for items, _ in recorded.views), "the key never left the view"
    finally:
        keep_alive.cancel()
        await session.revoke()
        await holder.close()


async def test_a_key_not_put_back_leaves_the_view_when_its_grace_ends(etcd: ManagedProcess) -> None:
    holder = connect(etcd.address)
    try:
        lease = await holder.lease(TTL_S)
        await holder.put(KEY.encode(), b"about to die", lease=lease.id)
        async with RecordedView(etcd.address, grace_s=0.5) as recorded:
            await holder.revoke_lease(lease.id)  # its holder is gone: nothing puts it back
            await asyncio.wait_for(recorded.view.wait_for(lambda items: KEY not in items), 5)
            assert recorded.was_lapsed()
    finally:
        await holder.close()


async def test_a_holder_that_leaves_cleanly_leaves_the_view_at_once(etcd: ManagedProcess) -> None:
    holder = connect(etcd.address)
    session = LeaseSession(holder, ttl_s=TTL_S)
    await session.put(KEY, b"leaving soon")
    try:
        async with RecordedView(etcd.address, grace_s=60) as recorded:
            await session.revoke()
            # Far sooner than the grace: the holder said it was leaving, so the view holds nothing.
            await asyncio.wait_for(recorded.view.wait_for(lambda items: KEY not in items), 10)
            assert not recorded.was_lapsed()
    finally:
        await holder.close()


@pytest.mark.parametrize("old_writes_again", [True, False])
async def test_a_process_started_in_anothers_place_keeps_the_key_when_the_other_leaves(
        etcd: ManagedProcess, old_writes_again: bool) -> None:
    """A node agent restarted under its id registers before the old process has drained: the old one's leaving
    mark and revoke took the new one's key with them, and the new process was gone from the fleet for good, serving
    and healthy (helper-158). The key's first put takes it over; the old holder's later writes give it up."""
    old_client, new_client = connect(etcd.address), connect(etcd.address)
    old, new = LeaseSession(old_client, ttl_s=TTL_S), LeaseSession(new_client, ttl_s=TTL_S)
    try:
        await old.put(KEY, b"old")
        await new.put(KEY, b"new")
        if old_writes_again:
            await old.put(KEY, b"old, draining")  # what a node agent's before_stop writes
            # A later write (a model turned warm meanwhile) took it back, and the exit deleted it (helper-162).
            await old.put(KEY, b"old, draining, a model changed")
        await old.revoke()
        stored = await new_client.get(KEY.encode())
        assert stored is not None and (stored.value, stored.lease) == (b"new", new.lease_id)
        # The new holder's own writes go on.
        await new.put(KEY, b"new, changed")
        stored = await new_client.get(KEY.encode())
        assert stored is not None and (stored.value, stored.lease) == (b"new, changed", new.lease_id)
    finally:
        await new.revoke()
        await old_client.close()
        await new_client.close()


@pytest.mark.parametrize("first_writes_again", [True, False])
async def test_a_key_another_process_took_is_held_again_once_that_one_has_gone(
        etcd: ManagedProcess, first_writes_again: bool) -> None:
    """Of two holders whose leases both lapsed in an etcd freeze, the one that re-registered first kept the key, and
    the other, given it up, never held it again, though the first then left (helper-162). And a second node agent
    started under a live one's id took its key, and its leaving deleted it: the first agent, which had nothing new to
    write, never noticed and was gone from the fleet for good, serving and healthy (helper-196). Its keep-alive checks
    that the key is still its own."""
    first_client, second_client = connect(etcd.address), connect(etcd.address)
    first, second = LeaseSession(first_client, ttl_s=TTL_S), LeaseSession(second_client, ttl_s=TTL_S)
    keep_alive = None
    try:
        await first.put(KEY, b"first")
        await second.put(KEY, b"second")  # taken over
        if first_writes_again:
            await first.put(KEY, b"first again")  # given up: the second holds it
            stored = await first_client.get(KEY.encode())
            assert stored is not None and stored.value == b"second"
        keep_alive = asyncio.create_task(first.keep_alive())
        await second.revoke()  # the second leaves: its leaving mark and revoke delete the key
        value = b"first again" if first_writes_again else b"first"

        async def held_again() -> bool:
            stored = await first_client.get(KEY.encode())
            return stored is not None and (stored.value, stored.lease) == (value, first.lease_id)

        await eventually(held_again, 10, "the first holder to put its key back at a keep-alive")
    finally:
        if keep_alive is not None:
            keep_alive.cancel()
        await first.revoke()
        await first_client.close()
        await second_client.close()
