"""No single point of failure: scheduler failover, kvindex replicas, etcd outages, nodes coming back."""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.client import BatonClient
from baton.cluster import (ClusterSpec, LocalCluster, ManagedProcess, StartError, free_port, start_etcd,
                           wait_grpc_serving)
from baton.v1 import kvindex_pb2, kvindex_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.common import etcd_keys
from services.common.block_hash import block_hashes
from services.common.etcd_session import connect
from tests.integration.conftest import MODEL, eventually
from tests.integration.load import SteadyLoad

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

TTL_S = 2


def start(tmp_path_factory: pytest.TempPathFactory, **settings: object) -> LocalCluster:
    spec = {"num_nodes": 3, "speed": 10.0, "lease_ttl_s": TTL_S, **settings}
    cluster = LocalCluster(ClusterSpec(**spec), tmp_path_factory.mktemp("cluster"))  # type: ignore[arg-type]
    cluster.start()
    return cluster


@pytest.fixture
def three_schedulers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = start(tmp_path_factory, num_schedulers=3, num_kvindexes=2, num_routers=2)
    try:
        yield cluster
    finally:
        cluster.stop()


def leader_process(cluster: LocalCluster) -> ManagedProcess:
    leader_id = cluster.cluster_state().leader_id
    return next(p for p in cluster.schedulers if p.name == leader_id)


def leader_tasks(cluster: LocalCluster) -> scheduler_pb2.TaskStats:
    """The KPI ledger as the leader reports it."""
    with grpc.insecure_channel(leader_process(cluster).address) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).GetClusterState(
            scheduler_pb2.GetClusterStateRequest(), timeout=2).tasks


async def handed_over_successes(cluster: LocalCluster) -> int:
    """Successful tasks in the state the leader last wrote for its successor."""
    client = connect(cluster.etcd_endpoint)
    try:
        stored = await client.get(etcd_keys.SCHEDULER_STATE.encode())
    finally:
        await client.close()
    return json.loads(stored.value)["tasks"]["succeeded"] if stored is not None else 0


async def test_killing_the_scheduler_leader_fails_no_request(three_schedulers: LocalCluster) -> None:
    cluster = three_schedulers
    load = SteadyLoad([router.address for router in cluster.routers])
    load.start()
    await load.wait_completed(10)
    await eventually(lambda: leader_tasks(cluster).tasks_succeeded >= 10, 10, "the leader to count 10 tasks")
    await eventually(functools.partial(handed_over_successes, cluster), 10, "the ledger in the hand-over state")
    handed_over = await handed_over_successes(cluster)
    old = leader_process(cluster)
    old.signal(signal.SIGKILL)
    await eventually(lambda: cluster.cluster_state().leader_id not in ("", old.name), 4 * TTL_S,
                     "a standby to take over")
    await load.wait_completed(20)
    await load.stop()
    assert load.failures == []
    # The successor carried the KPI's ledger on (at least what was handed over) and kept counting.
    await eventually(lambda: leader_tasks(cluster).tasks_succeeded >= handed_over + 20, 10,
                     "the new leader to count on from the handed-over tasks")


def scheduler_health(process: ManagedProcess, service: str) -> int:
    """What process's gRPC health says of service (a health_pb2.HealthCheckResponse status)."""
    with grpc.insecure_channel(process.address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=2).status


async def test_grpc_health_tells_the_leading_scheduler_from_a_standby(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A standby was SERVING for baton.v1.Scheduler, like the leader, though it places nothing: a probe (grpcurl,
    a load balancer's health check) could not tell them apart. "" still says each process is up."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    cluster = start(tmp_path_factory, num_nodes=1, num_schedulers=2)
    try:
        leader = leader_process(cluster)
        standby = next(p for p in cluster.schedulers if p is not leader)
        # etcd shows the leader before it has restored its predecessor's state, when it begins to serve.
        await eventually(lambda: scheduler_health(leader, "baton.v1.Scheduler") == serving, 4 * TTL_S,
                         "the leader to serve baton.v1.Scheduler")
        assert scheduler_health(standby, "baton.v1.Scheduler") == not_serving
        assert [scheduler_health(p, "") for p in (leader, standby)] == [serving, serving]
        leader.signal(signal.SIGKILL)
        await eventually(lambda: scheduler_health(standby, "baton.v1.Scheduler") == serving, 4 * TTL_S,
                         "the standby, now leading, to serve baton.v1.Scheduler")
        assert cluster.cluster_state().leader_id == standby.name
    finally:
        cluster.stop()


async def test_a_node_agent_or_kvindex_serves_its_own_name_only_once_registered_in_etcd(
        etcd: ManagedProcess, tmp_path: Path) -> None:
    """A compose container whose service never reached etcd showed healthy: the health check asked of "" (the
    process is up), and a node agent's and a kvindex's own names served from the start (helper-175)."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    etcd.signal(signal.SIGSTOP)  # unreachable: it accepts connections and answers nothing
    processes = []
    for name, module in (("node-0", "services.node_agent"), ("kvindex-0", "services.kvindex")):
        address = f"127.0.0.1:{free_port()}"
        processes.append(ManagedProcess(name=name, log_path=tmp_path / f"{name}.log", address=address, args=[
            sys.executable, "-m", module, "--listen", address, "--etcd", etcd.address, "--lease-ttl-s", "3"]))
    try:
        for process in processes:
            process.start()
            wait_grpc_serving(process, 30)  # "": the process is up
        names = ("baton.v1.NodeAgent", "baton.v1.KVIndex")
        assert [scheduler_health(p, name) for p, name in zip(processes, names, strict=True)] == [not_serving] * 2
        etcd.signal(signal.SIGCONT)
        for process, name in zip(processes, names, strict=True):
            await eventually(functools.partial(lambda p, n: scheduler_health(p, n) == serving, process, name), 30,
                             f"{process.name} to serve {name} once registered")
    finally:
        etcd.signal(signal.SIGCONT)
        for process in processes:
            process.stop()


async def test_a_third_scheduler_joins_and_survives_the_other_two(tmp_path_factory: pytest.TempPathFactory) -> None:
    cluster = start(tmp_path_factory, num_schedulers=2)
    try:
        load = SteadyLoad([router.address for router in cluster.routers])
        load.start()
        await load.wait_completed(5)
        third = cluster.add_scheduler()
        for process in cluster.schedulers[:2]:
            process.signal(signal.SIGKILL)
        await eventually(lambda: cluster.cluster_state().leader_id == third.name, 4 * TTL_S, "the third to lead")
        await load.wait_completed(15)
        await load.stop()
        assert load.failures == []
    finally:
        cluster.stop()


async def test_an_etcd_outage_under_load_fails_no_request_and_the_cluster_reconverges(
    three_schedulers: LocalCluster,
) -> None:
    cluster = three_schedulers
    assert cluster.etcd is not None
    load = SteadyLoad([router.address for router in cluster.routers])
    load.start()
    await load.wait_completed(10)
    leader = cluster.cluster_state().leader_id

    cluster.etcd.signal(signal.SIGKILL)
    # No leader can confirm its lease without etcd, so within the TTL placements are held (never
    # refused); generations already placed stream on. The held placements go on once etcd is back.
    await asyncio.sleep(10)  # the outage's length: a fault's duration, not a synchronisation
    assert all(p.is_running() for p in [*cluster.schedulers, *cluster.kvindexes, *cluster.nodes, *cluster.routers])
    cluster.restart(cluster.etcd)

    expected = ({f"{etcd_keys.NODES}node-{i}" for i in range(3)}
                | {etcd_keys.service_key("scheduler", f"scheduler-{i}") for i in range(3)}
                | {etcd_keys.service_key("kvindex", f"kvindex-{i}") for i in range(2)}
                | {etcd_keys.service_key("router", f"router-{i}") for i in range(2)})
    client = connect(cluster.etcd.address)
    try:
        async with asyncio.timeout(30):
            while True:
                listing = await client.get_prefix(etcd_keys.PREFIX.encode())
                keys = [kv.key.decode() for kv in listing]
                candidates = [k for k in keys if k.startswith(etcd_keys.SCHEDULER_ELECTION)]
                if expected <= set(keys) and len(candidates) == 3:
                    break
                await asyncio.sleep(0.1)
    finally:
        await client.close()
    assert len(keys) == len(set(keys))  # no duplicate registrations
    assert sum(1 for k in keys if k.startswith(etcd_keys.NODES)) == 3
    await load.wait_completed(10)
    await load.stop()
    assert load.failures == []
    state = cluster.cluster_state()
    assert len(state.nodes) == 3 and state.leader_id in (leader, *[p.name for p in cluster.schedulers])


async def test_the_mesh_lives_through_the_death_of_the_etcd_member_every_service_talks_to(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    cluster = start(tmp_path_factory, etcd_members=3, num_nodes=2)
    try:
        first, _, last = cluster.etcd_members
        load = SteadyLoad([router.address for router in cluster.routers])
        load.start()
        await load.wait_completed(5)
        leader = cluster.cluster_state().leader_id

        first.signal(signal.SIGKILL)  # every service was given it first, and talks to it
        # Twice the lease TTL: a service still bound to the dead member would have left etcd, its leader lost.
        await asyncio.sleep(4 * TTL_S)  # the outage's length: a fault's duration, not a synchronisation
        cluster.restart(cluster.nodes[0])  # a process started now finds a live member past the dead first one

        # Each service that ran through the death still holds its keys (node-0 was restarted since).
        expected = {f"{etcd_keys.NODES}node-1",
                    *(etcd_keys.service_key(kind, f"{kind}-0") for kind in ("scheduler", "kvindex", "router"))}
        client = connect(last.address)
        try:
            listing = await client.get_prefix(etcd_keys.PREFIX.encode())
            assert expected <= {kv.key.decode() for kv in listing}, "a service left etcd with its member's death"
            await eventually(lambda: cluster.cluster_state().leader_id == leader and
                             len(cluster.cluster_state().nodes) == 2, 20, "the leader to see both nodes")
        finally:
            await client.close()
        await load.wait_completed(10)
        await load.stop()
        assert load.failures == []
    finally:
        cluster.stop()


async def overlaps(address: str, prompts: list[str]) -> list[dict[str, int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = kvindex_pb2_grpc.KVIndexStub(channel)
        replies = [await stub.QueryOverlap(kvindex_pb2.OverlapRequest(
            model=MODEL, block_hashes=block_hashes(list(p.encode())))) for p in prompts]
    return [dict(reply.matched_blocks) for reply in replies]


async def test_a_restarted_kvindex_replica_catches_up_with_the_other(three_schedulers: LocalCluster) -> None:
    cluster = three_schedulers
    first, second = cluster.kvindexes
    load = SteadyLoad([router.address for router in cluster.routers])
    load.start()
    await load.wait_completed(10)
    second.signal(signal.SIGKILL)
    await load.wait_completed(20)  # the survivor keeps learning; placements fail over to it
    cluster.restart(second)
    await load.wait_completed(5)
    await load.stop()
    assert load.failures == []

    prompts = sorted(set(load.prompts))

    async def answers_of(address: str) -> list[dict[str, int]] | str:
        try:
            return await overlaps(address, prompts)
        except grpc.aio.AioRpcError as refused:  # a replica still catching up refuses, naming why
            assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
            return refused.details() or ""

    deadline = time.monotonic() + 15
    while (answers := await answers_of(second.address)) != await answers_of(first.address):
        assert time.monotonic() < deadline, f"replicas disagree: {answers}"
        await asyncio.sleep(0.1)
    assert isinstance(answers, list) and all(answers), "the restarted replica knows where every prompt is cached"


async def test_a_node_whose_lease_ended_rejoins_with_its_kv_index_resynced(three_schedulers: LocalCluster) -> None:
    cluster = three_schedulers
    prompt = "cached on one node before it froze " * 4
    assert cluster.router is not None
    async with BatonClient(cluster.router.address) as client:
        placed = await client.complete(MODEL, prompt, max_tokens=4)
    node = next(p for p in cluster.nodes if p.name == placed.node_ids[0])

    async def indexed_on(kvindex: ManagedProcess) -> bool:
        return node.name in (await overlaps(kvindex.address, [prompt]))[0]

    def listed() -> bool:
        return node.name in {n.info.node_id for n in cluster.cluster_state().nodes}

    for kvindex in cluster.kvindexes:
        await eventually(functools.partial(indexed_on, kvindex), 10, f"{kvindex.name} to learn the prompt's blocks")

    node.signal(signal.SIGSTOP)  # silent: its lease ends and it leaves
    await eventually(lambda: not listed(), 5 * TTL_S, f"{node.name} to leave")
    for kvindex in cluster.kvindexes:
        assert not await indexed_on(kvindex), f"{kvindex.name} still places work on a departed node"

    node.signal(signal.SIGCONT)  # back: re-registers, and the replicas re-sync what it caches
    await eventually(listed, 5 * TTL_S, f"{node.name} to rejoin")
    for kvindex in cluster.kvindexes:
        await eventually(functools.partial(indexed_on, kvindex), 10, f"{kvindex.name} to re-sync {node.name}")


async def test_a_cluster_started_where_an_earlier_one_ran_does_not_inherit_its_ledger(tmp_path) -> None:
    # `baton up --workdir DIR` again: the earlier cluster's etcd, left in DIR, held a task ledger (here 48
    # successes) that the new leader restored, with a differently sized fleet's costs (a review saw it).
    workdir = tmp_path / "work"
    workdir.mkdir()
    earlier = start_etcd(workdir)
    try:
        ledger = {"succeeded": 48, "failed": 0, "ended_cost_usd": 0.1, "open": {}, "ended": []}
        state = {"leader": "scheduler-0", "retry_budget": {"requests": 0, "retries": 0}, "tasks": ledger}
        client = connect(earlier.address)
        try:
            await client.put(etcd_keys.SCHEDULER_STATE.encode(), json.dumps(state).encode())
        finally:
            await client.close()
    finally:
        earlier.stop()
    cluster = LocalCluster(ClusterSpec(num_nodes=1, speed=0.0, lease_ttl_s=TTL_S), workdir)
    try:
        await asyncio.to_thread(cluster.start)
        await eventually(lambda: cluster.cluster_state().leading_revision, 30, "the scheduler to lead")
        assert cluster.cluster_state().tasks.tasks_succeeded == 0
    finally:
        await asyncio.to_thread(cluster.stop)



def test_a_cluster_is_refused_a_workdir_whose_etcd_outlived_its_baton_up(tmp_path) -> None:
    # A SIGKILLed `baton up` releases the workdir lock, but its etcd (its own process group) runs on: the next
    # `up` there must not remove that etcd's data from under it.
    workdir = tmp_path / "work"
    workdir.mkdir()
    orphan = start_etcd(workdir)
    try:
        wal = sorted((workdir / "etcd").rglob("*.wal"))
        cluster = LocalCluster(ClusterSpec(num_nodes=1, speed=0.0, lease_ttl_s=TTL_S), workdir)
        try:
            with pytest.raises(StartError, match=f"an etcd still runs on .*pid {orphan.pid}"):
                cluster.start()
        finally:
            cluster.stop()  # had it started (the check missing), what it started
        assert wal and all(path.exists() for path in wal)
    finally:
        orphan.stop()

def test_a_second_cluster_is_refused_a_workdir_a_running_one_holds(tmp_path) -> None:
    # Starting it would remove the running cluster's etcd data from under it (a review saw its WAL deleted).
    workdir = tmp_path / "work"
    with LocalCluster(ClusterSpec(num_nodes=1, speed=0.0, lease_ttl_s=TTL_S), workdir):
        wal = sorted((workdir / "etcd").rglob("*.wal"))
        second = LocalCluster(ClusterSpec(num_nodes=1, speed=0.0, lease_ttl_s=TTL_S), workdir)
        with pytest.raises(StartError, match="is in use by a running cluster"):
            second.start()
        assert wal and all(path.exists() for path in wal)
    # Stopped, it gives the workdir up.
    with LocalCluster(ClusterSpec(num_nodes=1, speed=0.0, lease_ttl_s=TTL_S), workdir) as third:
        assert third.cluster_state().nodes
