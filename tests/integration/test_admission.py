"""Delay: admission at the scheduler leader under overload — refusals, fairness, bounds."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import grpc
import pytest

from baton.client import BatonClient
from baton.cluster import ClusterSpec, LocalCluster
from baton.protocol import RETRY_AFTER_KEY
from tests.integration.conftest import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL = "sim-llama-3-8b"


@pytest.fixture
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One node that runs two sequences at a time (so a queue builds), a capped tenant, a short queue."""
    limits = json.dumps({"capped": {"max_concurrency": 1}})
    spec = ClusterSpec(num_nodes=1, speed=5.0, node_args=("--max-num-seqs=2",),
                       scheduler_args=(f"--tenant-limits={limits}", "--max-queued=12"))
    with LocalCluster(spec, tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


async def outcome(client: BatonClient, prompt: str, **fields: object) -> tuple[str, float, float]:
    """(status, seconds to the status or the end, finish time)."""
    started = time.monotonic()
    try:
        await client.complete(MODEL, prompt, timeout_s=90, **fields)
        return "OK", time.monotonic() - started, time.monotonic()
    except grpc.aio.AioRpcError as error:
        return error.code().name, time.monotonic() - started, time.monotonic()


async def test_a_ttft_budget_no_idle_node_could_meet_is_refused_at_once_as_invalid(small: LocalCluster) -> None:
    """Under the router's 10 ms floor it is refused there; above it, the leader refuses one under a slow engine's
    floor the same way (tests/unit/test_placement.py: the sim's GPUs have none that high)."""
    assert small.router is not None
    async with BatonClient(small.router.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.complete(MODEL, "a long prompt that cannot be read in time. " * 150, max_tokens=8,
                                  ttft_budget_ms=2)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (raised.value.details() or "").startswith("ttft_budget_ms=2: below the floor of 10 ms")
    assert RETRY_AFTER_KEY not in dict(raised.value.trailing_metadata())


async def test_a_tenant_over_its_concurrency_limit_is_refused_naming_the_limit(small: LocalCluster) -> None:
    assert small.router is not None
    async with BatonClient(small.router.address) as client:
        first = asyncio.create_task(client.complete(MODEL, "the capped tenant's one request", max_tokens=200,
                                                    ignore_eos=True, tenant="capped"))
        await asyncio.sleep(0)
        while not first.done() and not small.cluster_state().nodes[0].load.num_running:
            await asyncio.sleep(0.02)  # until the first is running
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.complete(MODEL, "a second one at once", max_tokens=8, tenant="capped")
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "concurrency limit of 1" in raised.value.details()
        await first
        deadline = time.monotonic() + 10
        while True:  # the router's Finished notice releases the slot
            status, _, _ = await outcome(client, "and now another", max_tokens=8, tenant="capped")
            if status == "OK" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert status == "OK"


async def test_a_flooding_tenant_does_not_starve_another(small: LocalCluster) -> None:
    assert small.router is not None
    async with BatonClient(small.router.address) as client:
        # The calm tenant comes once the leader's queue holds the flood's backlog, as the leader reports
        # it (waiting on the node's queue instead, the whole flood sometimes reached the node first and
        # the calm tenant, admitted at once behind it, finished last: a test of timing, not of fair share).
        flood = [asyncio.create_task(outcome(client, f"flood {i}", max_tokens=200, ignore_eos=True,
                                             tenant="flood", priority=1)) for i in range(20)]
        held: list[int] = []
        give_up = time.monotonic() + 30
        while (queued := (await asyncio.to_thread(small.cluster_state)).queued_by_tenant.get("flood", 0)) < 8:
            held.append(queued)  # until the flood holds the node and its backlog waits at the leader
            assert time.monotonic() < give_up, f"the leader held at most {max(held)} of the flood in its queue"
            await asyncio.sleep(0.02)
        calm = [asyncio.create_task(outcome(client, f"calm {i}", max_tokens=200, ignore_eos=True, tenant="calm",
                                            priority=1)) for i in range(3)]
        flood_done, calm_done = await asyncio.gather(asyncio.gather(*flood), asyncio.gather(*calm))
    assert all(status == "OK" for status, _, _ in calm_done)
    flood_finishes = sorted(t for status, _, t in flood_done if status == "OK")
    assert len(flood_finishes) >= 14  # the queue (12) holds the rest of the flood; the excess is refused
    # The node itself holds a few of the flood (2 running, about 5 waiting: then the fleet counts as
    # saturated and the leader queues the rest, 12 at most). First come, first served, the calm tenant
    # would be refused (the queue is full of flood) or served after all of it; with fair share it takes
    # a flood entry's place in the queue and leaves the queue ahead of the flood's backlog (about 9).
    # An order of events, not a race of latencies: requests of the same length, the calm tenant's all
    # done while at least four of the flood's are still to finish (first come, first served: none).
    calm_finishes = sorted(t for _, _, t in calm_done)
    assert calm_finishes[-1] < flood_finishes[-4], (
        f"calm finished at {[round(t - flood_finishes[0], 2) for t in calm_finishes]} s, "
        f"flood at {[round(t - flood_finishes[0], 2) for t in flood_finishes]} s")


async def test_overload_keeps_high_priority_and_refuses_the_rest_quickly(small: LocalCluster) -> None:
    assert small.router is not None
    async with BatonClient(small.router.address) as client:
        low = [asyncio.create_task(outcome(client, f"low {i}", max_tokens=40, ignore_eos=True, tenant="bulk"))
               for i in range(40)]
        while small.cluster_state().nodes[0].load.num_running < 2:
            await asyncio.sleep(0.02)
        # Until the leader has seen one of these 40-token answers end, it expects the 256-token default,
        # and four high-priority requests in line behind a full node look six times longer to serve than
        # they are: the last could be refused as unable to meet its 20 s budget (CI, on a busy machine).
        await eventually(lambda: small.cluster_state().tasks.tasks_succeeded >= 1, 60,
                         "the leader to count a low-priority answer ended")
        high = [asyncio.create_task(outcome(client, f"high {i}", max_tokens=40, ignore_eos=True, tenant="vip",
                                            priority=5, ttft_budget_ms=20_000)) for i in range(4)]
        low_done, high_done = await asyncio.gather(asyncio.gather(*low), asyncio.gather(*high))
    assert [status for status, _, _ in high_done] == ["OK"] * 4
    refused_at = [at for status, _, at in low_done if status == "RESOURCE_EXHAUSTED"]
    assert refused_at, "a queue bounded at 12 must refuse some of 40"
    # Refused at once (on arrival, or when a high-priority request takes the place), not after waiting
    # for capacity: every refusal came before the first high-priority request was done.
    assert max(refused_at) < min(at for _, _, at in high_done)
    assert all(p.is_running() for p in [*small.schedulers, *small.routers, *small.nodes])
