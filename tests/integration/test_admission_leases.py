"""Admission slots cannot leak: a request whose end never reaches the leader frees its slot by lease,
and one that lives longer than the lease keeps it because its router reports it live."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import pytest

from baton.client import BatonClient
from baton.cluster import ClusterSpec, LocalCluster
from baton.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.integration.conftest import MODEL, eventually, wait_router_serves

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LEASE_S = 3.0


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One real-time node; tenants "a" and "b" each capped at one request; short leases, frequent reports."""
    limits = json.dumps({"a": {"max_concurrency": 1}, "b": {"max_concurrency": 1}})
    spec = ClusterSpec(num_nodes=1, speed=1.0,
                       scheduler_args=(f"--tenant-limits={limits}", f"--admission-lease-s={LEASE_S}"),
                       router_args=("--live-report-interval-s=0.5",))
    with LocalCluster(spec, tmp_path_factory.mktemp("cluster")) as cluster:
        wait_router_serves(cluster)
        yield cluster


async def status_of(client: BatonClient, tenant: str) -> str:
    """OK, or the status code and message a short request of tenant's gets."""
    try:
        await client.complete(MODEL, "a short one", max_tokens=4, tenant=tenant, timeout_s=30)
        return "OK"
    except grpc.aio.AioRpcError as error:
        return f"{error.code().name}: {error.details()}"


AT_LIMIT = "RESOURCE_EXHAUSTED: tenant {!r} is at its concurrency limit of 1"


async def test_a_slot_whose_end_never_reaches_the_leader_is_freed_by_its_lease(capped: LocalCluster) -> None:
    assert capped.router is not None and capped.scheduler is not None
    # A router placed a request for tenant "a" and died: no Finished notice, no report will come.
    async with grpc.aio.insecure_channel(capped.scheduler.address) as channel:
        placement = await scheduler_pb2_grpc.SchedulerStub(channel).Place(
            scheduler_pb2.PlaceRequest(request_id="orphan", model=MODEL, num_prompt_tokens=8, max_tokens=8,
                                       context=common_pb2.RequestContext(tenant="a")), timeout=10)
    assert placement.node_id
    async with BatonClient(capped.router.address) as client:
        assert (await status_of(client, "a")).startswith(AT_LIMIT.format("a"))

        async def admitted() -> bool:
            return await status_of(client, "a") == "OK"

        await eventually(admitted, 10 * LEASE_S, "tenant a's orphaned slot to be freed by its lease")


async def test_a_stream_longer_than_the_lease_keeps_its_slot(capped: LocalCluster) -> None:
    assert capped.router is not None
    async with BatonClient(capped.router.address) as client:
        stream = client.generate(MODEL, "a long one", max_tokens=6000, ignore_eos=True, tenant="b", timeout_s=90)
        started = time.monotonic()
        try:
            # Read the stream until it has lived for three leases (and a sweep) past its admission.
            async for chunk in stream:
                assert not chunk.finish_reason, "the stream ended before it outlived the lease"
                if time.monotonic() - started > 3 * LEASE_S + 1:
                    break
            assert (await status_of(client, "b")).startswith(AT_LIMIT.format("b"))
        finally:
            await stream.aclose()

        async def admitted() -> bool:
            return await status_of(client, "b") == "OK"

        await eventually(admitted, 10 * LEASE_S, "tenant b's slot to be freed once its stream was cancelled")


def test_the_leader_answers_live_reports_with_its_lease(capped: LocalCluster) -> None:
    assert capped.scheduler is not None
    with grpc.insecure_channel(capped.scheduler.address) as channel:
        ack = scheduler_pb2_grpc.SchedulerStub(channel).ReportLiveRequests(
            scheduler_pb2.LiveRequests(router_id="test", request_ids=["nobody"]), timeout=5)
    assert (ack.num_held, ack.lease_ms) == (0, LEASE_S * 1000)
