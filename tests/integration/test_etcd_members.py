"""A client given every member of a real three-member etcd cluster lives through the death or freeze of the member it
talks to: its lease, its keys and its watches go on through another member."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import aetcd
import pytest

from baton.cluster import ManagedProcess, start_etcd_members
from services.common.etcd_session import Membership, PrefixView, connect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

TTL_S = 3


@pytest.fixture
def members(tmp_path: Path) -> Iterator[list[ManagedProcess]]:
    started = start_etcd_members(tmp_path, 3)
    try:
        yield started
    finally:
        for member in started:
            member.stop()


@pytest.mark.parametrize("fault", ["killed", "frozen"])
async def test_a_membership_moves_to_another_member_when_its_own_fails(members: list[ManagedProcess],
                                                                        fault: str) -> None:
    endpoints = ",".join(member.address for member in members)
    membership = Membership(endpoints, TTL_S)
    own_view = PrefixView(membership.client, "/test/")
    observer = connect(members[2].address)
    observed = PrefixView(observer, "/test/")
    tasks = [asyncio.create_task(loop) for loop in [*membership.hold("/test/held", b"1"), own_view.run(),
                                                     observed.run()]]
    try:
        async with asyncio.timeout(20):
            await own_view.wait_for(lambda items: "/test/held" in items)
        assert membership.client.endpoint == members[0].address  # it talks to the first, the one that fails

        members[0].signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        await membership.update("/test/written-after", b"2")  # fails on the first member, is put again later
        await observer.put(b"/test/put-by-another", b"3")
        async with asyncio.timeout(20):
            await observed.wait_for(lambda items: "/test/written-after" in items)
            await own_view.wait_for(lambda items: "/test/put-by-another" in items)
        assert membership.client.endpoint != members[0].address
        assert (await observer.get(b"/test/held")) is not None  # held all along, or put again under a new lease
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await membership.client.close()
        await observer.close()


async def test_a_client_whose_first_member_is_down_uses_the_next(members: list[ManagedProcess]) -> None:
    members[0].signal(signal.SIGKILL)
    client = connect(",".join(member.address for member in members))
    try:
        async with asyncio.timeout(20):
            while True:
                try:
                    await client.put(b"/test/key", b"value")
                    break
                except Exception:  # noqa: BLE001 - the first call meets the dead member; the next goes elsewhere
                    await asyncio.sleep(0.1)
        assert (await client.get(b"/test/key")).value == b"value"
        assert client.endpoint == members[1].address
    finally:
        await client.close()


async def test_a_lease_kept_alive_on_a_frozen_member_moves_to_the_next(members: list[ManagedProcess]) -> None:
    """A keep-alive (a stream) that timed out did not move the client: a node whose member froze while its lease's
    keep-alive was its only call to etcd left the fleet (the compose test's paused member)."""
    client = connect(",".join(member.address for member in members))
    try:
        lease = await client.lease(TTL_S * 3)
        members[0].signal(signal.SIGSTOP)
        with pytest.raises(aetcd.exceptions.ConnectionTimeoutError):
            await client.refresh_lease(lease.id)
        assert client.endpoint == members[1].address
        assert (await client.refresh_lease(lease.id)).TTL > 0
    finally:
        await client.close()
