"""The routers' view of the scheduler leader, on a real etcd."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from baton.cluster import ManagedProcess
from services.common.directory import LeaderDirectory, LeaderRecord
from services.common.etcd_session import connect
from services.common.telemetry import Telemetry
from tests.integration.conftest import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PREFIX = "/test/leader/"


async def test_a_leader_reachable_before_etcd_shows_any_leader_is_waited_for(etcd: ManagedProcess) -> None:
    # A scheduler restarted in place after its old key expired serves before it campaigns: a router
    # whose channel reconnects in that moment must wait for the election, not give up on leaders.
    client = connect(etcd.address)
    directory = LeaderDirectory(client, PREFIX, Telemetry("router/test", "none"))
    view = asyncio.create_task(directory.run())
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    try:
        old = LeaderRecord(key=f"{PREFIX}old", revision=1, address=f"127.0.0.1:{port}")  # its key is gone
        await server.start()
        waiting = asyncio.create_task(directory.wait_other_or_reachable(old, 10))
        channel = directory.channel(old.address)
        await eventually(lambda: channel.get_state() == grpc.ChannelConnectivity.READY, 5,
                         "the channel to the restarted replica to connect")
        lease = await client.lease(10)
        await client.put(f"{PREFIX}new".encode(), json.dumps({"address": old.address}).encode(), lease=lease)
        elected = await asyncio.wait_for(waiting, 5)
        assert elected is not None and elected.key == f"{PREFIX}new" and elected.address == old.address
    finally:
        view.cancel()
        await server.stop(None)
        await directory.close()
        await client.close()
