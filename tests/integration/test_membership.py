"""Nodes leaving: lease expiry after a kill, graceful shutdown on SIGTERM."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from baton.client import BatonClient, Completion
from baton.cluster import ClusterSpec, LocalCluster
from baton.v1 import common_pb2
from services.common.etcd_session import connect
from tests.integration.conftest import MODEL, wait_until
from tests.reference import reference_completion

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def small_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three h100 nodes in real time, with 2 s leases so departures show quickly."""
    spec = ClusterSpec(num_nodes=3, speed=1.0, lease_ttl_s=2)
    with LocalCluster(spec, tmp_path_factory.mktemp("cluster")) as started:
        yield started


def node_ids(cluster: LocalCluster) -> set[str]:
    return {n.info.node_id for n in cluster.cluster_state().nodes}


def process_of(cluster: LocalCluster, node_id: str):
    return next(p for p in cluster.nodes if p.name == node_id)


async def test_a_killed_node_leaves_the_view_when_its_lease_ends(small_cluster: LocalCluster) -> None:
    victim = small_cluster.nodes[1]
    victim.signal(signal.SIGKILL)
    wait_until(lambda: victim.name not in node_ids(small_cluster), 15, f"{victim.name} to leave the view")
    assert node_ids(small_cluster) == {"node-0", "node-2"}

    assert small_cluster.router is not None
    async with BatonClient(small_cluster.router.address) as client:
        models = await client.list_models()
        results = [await client.complete(MODEL, f"after the kill {i}", max_tokens=4) for i in range(6)]
    assert models[0].num_warm_nodes == 2
    assert all(r.node_ids[0] != victim.name for r in results)


async def test_sigterm_finishes_in_flight_streams_then_deregisters(small_cluster: LocalCluster) -> None:
    prompt = "a stream that outlives its node's SIGTERM"
    assert small_cluster.router is not None
    async with BatonClient(small_cluster.router.address) as client:
        result = Completion()
        async for chunk in client.generate(MODEL, prompt, max_tokens=150, ignore_eos=True):
            if not result.token_ids:
                serving = process_of(small_cluster, chunk.node_id)
                serving.signal(signal.SIGTERM)
            result.add(chunk)

    assert result.token_ids == reference_completion(list(prompt.encode()), 150, ignore_eos=True)[0]
    assert result.finish_reason == common_pb2.FINISH_REASON_LENGTH
    # Drained where it ran: the stream never moved to another node.
    assert result.usage.num_migrations == 0 and result.node_ids == [serving.name]
    assert serving.proc is not None and serving.proc.wait(10) == 0
    wait_until(lambda: serving.name not in node_ids(small_cluster), 10, f"{serving.name} to deregister")



# Records no Baton process wrote, where services and nodes are listed: JSON that is not an object.
JUNK_RECORDS = {"/baton/services/scheduler/zz-junk": b"[]", "/baton/services/kvindex/zz-junk": b"5",
                "/baton/nodes/zz-junk": b"5"}


async def test_records_that_are_not_registrations_are_skipped_and_the_cluster_serves_on(
        small_cluster: LocalCluster) -> None:
    """One `[]` under /baton/services/scheduler/ killed every node agent within half a second, and a `5` under
    /baton/nodes/ froze the kvindex's view of the nodes (helper-181). Each reader now skips such a record, saying so."""
    async with connect(small_cluster.etcd_endpoint) as client:
        for key, value in JUNK_RECORDS.items():
            await client.put(key.encode(), value)
    for process, line in [*((node, "malformed scheduler registration") for node in small_cluster.nodes),
                          *((node, "malformed kvindex registration") for node in small_cluster.nodes),
                          (small_cluster.kvindex, "malformed node registration at /baton/nodes/zz-junk")]:
        assert process is not None
        wait_until(lambda p=process, line=line: line in p.log_path.read_text(errors="replace"), 15,
                   f"{process.name} to read the junk record")
    assert small_cluster.router is not None
    async with BatonClient(small_cluster.router.address) as client:
        results = [await client.complete(MODEL, f"beside the junk {i}", max_tokens=4) for i in range(6)]
    assert all(r.finish_reason for r in results)
    assert all(p.proc is not None and p.proc.poll() is None for p in small_cluster.processes)
    assert node_ids(small_cluster) == {"node-0", "node-1", "node-2"}
