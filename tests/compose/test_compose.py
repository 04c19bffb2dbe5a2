"""The docker compose deployment: images built here, the whole cluster up, streams through a router's
published port surviving a SIGKILLed node container and a killed scheduler leader.

Runs with `make test-compose` (BATON_COMPOSE_TEST=1); it installs Docker (Debian's docker.io and
docker-compose) when absent, starts dockerd when none answers and stops it afterwards by pid, and
builds the base images locally (deploy/compose/local/build-bases.sh), since no registry is reachable.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Iterator

import pytest

from baton.client import BatonClient, Completion
from baton.v1 import common_pb2
from tests.compose.deployment import Deployment, Images, brought_up
from tests.compose.engine import run
from tests.integration.conftest import MODEL, eventually
from tests.integration.load import SteadyLoad

pytestmark = [
    pytest.mark.skipif(os.environ.get("BATON_COMPOSE_TEST") != "1",
                       reason="the docker compose test runs with `make test-compose` (BATON_COMPOSE_TEST=1)"),
    pytest.mark.timeout(900),
]

PROJECT = "batontest"
NUM_TOKENS = 600


@pytest.fixture(scope="module")
def deployment(compose_images: Images) -> Iterator[Deployment]:
    with brought_up(compose_images, PROJECT, ["docker-compose.yml"]) as started:
        yield started


async def stream(client: BatonClient, prompt: str, on_chunk=None, max_tokens: int = NUM_TOKENS,
                 timeout_s: float = 120, **fields: object) -> Completion:
    result = Completion()
    async for chunk in client.generate(MODEL, prompt, max_tokens=max_tokens, ignore_eos=True, timeout_s=timeout_s,
                                       **fields):
        result.add(chunk)
        if on_chunk is not None:
            await on_chunk(result)
    return result


async def test_a_stream_survives_sigkill_of_its_node_container(deployment: Deployment) -> None:
    kinds: list[dict[str, object]] = [{}, {"temperature": 0.8, "seed": 7}]  # greedy, seeded sampling
    prompts = [f"compose stream {i}: a generation that outlives its node container" for i in range(len(kinds))]
    async with BatonClient(deployment.routers[0]) as client:
        uninterrupted = await asyncio.gather(*(stream(client, p, **k) for p, k in zip(prompts, kinds, strict=True)))
        killed: list[str] = []

        async def kill_the_greedy_streams_node(received: Completion) -> None:
            if not killed and len(received.token_ids) >= 10:
                node_id = received.node_ids[0]
                killed.append(node_id)
                container = node_id.rpartition("-")[2]  # a node's id is <gpu>-<its container's short id>
                await asyncio.to_thread(run, ["docker", "kill", "--signal", "KILL", container], deployment.log,
                                        timeout_s=30)

        greedy = stream(client, prompts[0], kill_the_greedy_streams_node, **kinds[0])
        results = await asyncio.gather(greedy, stream(client, prompts[1], **kinds[1]))

    assert killed, "the greedy stream reached a node"
    for before, after in zip(uninterrupted, results, strict=True):
        assert after.token_ids == before.token_ids
        assert len(after.token_ids) == NUM_TOKENS and after.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert after.is_exact
    moved = results[0]
    assert moved.node_ids[0] == killed[0] and killed[0] not in moved.node_ids[1:], moved.node_ids
    assert moved.usage.num_migrations == 1


async def test_requests_keep_succeeding_when_the_leading_scheduler_container_dies(deployment: Deployment) -> None:
    load = SteadyLoad(deployment.routers, num_workers=3)
    load.start()
    killed_at = "(not killed)"
    try:
        await load.wait_completed(6, timeout_s=60)
        leader = await asyncio.to_thread(deployment.scheduler_leader)
        assert leader in ("scheduler-1", "scheduler-2")
        killed_at = time.strftime("%H:%M:%S UTC", time.gmtime())
        await asyncio.to_thread(run, ["docker", "kill", "--signal", "KILL", *deployment.container_ids(leader)],
                                deployment.log, timeout_s=30)
        await eventually(lambda: deployment.scheduler_leader() not in ("", leader), 30, "the standby to lead")
        await load.wait_completed(15, timeout_s=90)
        await load.stop()
        assert load.failures == []
    except (AssertionError, TimeoutError, pytest.fail.Exception) as failed:
        # CI keeps no compose log: what the failover looked like goes into the failure itself.
        await load.stop()
        shown = await asyncio.to_thread(deployment.failover_log)
        raise AssertionError(f"{failed}\nthe leader was killed at {killed_at}; the logs:\n{shown}") from failed


async def test_no_service_leaves_the_fleet_while_an_etcd_member_container_is_paused(deployment: Deployment) -> None:
    """Each service talked to one etcd member: pausing etcd-2 for 15 s under load took the two nodes bound to it out
    of the fleet (helper-175). Each is now given every member and moves off the paused one."""
    load = SteadyLoad(deployment.routers, num_workers=3)
    load.start()
    try:
        await load.wait_completed(6, timeout_s=60)
        running = deployment.container_ids()  # a node's id ends in its container's short id (a prefix of these)
        leases = {node: lease for node, lease in deployment.registered_nodes("etcd-3").items()
                  if any(container.startswith(node.rpartition("-")[2]) for container in running)}
        assert len(leases) >= 3, leases
        deployment("pause", "etcd-2")
        try:
            # Five lease TTLs, looked at all along; at the end, each node is held under the lease it had: not one
            # that ran out, its key put again under a new one (the node gone from the fleet for a moment).
            paused_until = time.monotonic() + 15
            while time.monotonic() < paused_until:
                assert set(await asyncio.to_thread(deployment.registered_nodes, "etcd-3")) >= set(leases)
            assert deployment.registered_nodes("etcd-3").items() >= leases.items()
        finally:
            deployment("unpause", "etcd-2")
        await load.wait_completed(6, timeout_s=60)
        await load.stop()
        assert load.failures == []
    finally:
        await load.stop()


async def test_a_router_container_stopped_with_a_stream_in_flight_drains_and_exits_0(deployment: Deployment) -> None:
    """Docker's default stop timeout, 10 s, equal to the router's grace, SIGKILLed a router stopped with a stream in
    flight: exit 137, its streams' Finished notices unsent (helper-175)."""
    [router] = deployment.container_ids("router-1")
    stopped: list[float] = []

    async def stop_its_router(received: Completion) -> None:
        if not stopped and len(received.token_ids) >= 10:
            stopped.append(time.monotonic())
            await asyncio.to_thread(deployment, "stop", "router-1", timeout_s=90)

    try:
        async with BatonClient(deployment.routers) as client:  # router-1 first: the stream starts there
            # Longer than the router's grace (10 s): cut at its end, the stream moves to router-2.
            done = await stream(client, "compose stream: through a router that stops", stop_its_router,
                                max_tokens=NUM_TOKENS * 3, timeout_s=300)
        assert stopped and done.finish_reason == common_pb2.FINISH_REASON_LENGTH and done.is_exact
        code = run(["docker", "inspect", "--format", "{{.State.ExitCode}}", router], deployment.log,
                   timeout_s=30).stdout.strip()
        assert code == "0", deployment("logs", "--no-color", "--tail", "30", "router-1", check=False).stdout
    finally:
        deployment("start", "router-1")
        # (Only its own: the node container an earlier test SIGKILLed stays exited.)
        await eventually(functools.partial(deployment.are_all_healthy, "router-1"), 90, "router-1 healthy again")
