"""A client given every member of a real three-member etcd cluster lives through the death or freeze of the member it
talks to: its lease, its keys and its watches go on through another member.

The member faulted is one that does not lead etcd's raft: a leader's fault makes the cluster elect another, and
every member refuses calls meanwhile, which is etcd's outage, not a member's (docs/etcd.md).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import aetcd
import pytest

from baton.cluster import ManagedProcess, start_etcd_members
from services.common.election import Election
from services.common.etcd_session import Membership, PrefixView, connect
from tests.integration.conftest import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

# The default TTL: a keep-alive every second, so a member that freezes just after one leaves the client two seconds
# to move before the lease runs out.
TTL_S = 3


@pytest.fixture
def members(tmp_path: Path) -> Iterator[list[ManagedProcess]]:
    started = start_etcd_members(tmp_path, 3)
    try:
        yield started
    finally:
        for member in started:
            member.stop()


async def follower_first(members: list[ManagedProcess]) -> list[ManagedProcess]:
    """The members, one that does not lead etcd's raft first (the one to fault), the leader last."""
    client = connect(",".join(member.address for member in members))
    try:
        leader_urls = (await client.status()).leader.client_urls
    finally:
        await client.close()
    leader = next(m for m in members if any(url.endswith(f"//{m.address}") for url in leader_urls))
    return [*(m for m in members if m is not leader), leader]


@pytest.mark.parametrize("fault", ["killed", "frozen"])
async def test_a_membership_moves_to_another_member_with_its_lease_when_its_own_fails(members: list[ManagedProcess],
                                                                                     fault: str) -> None:
    victim, *others = await follower_first(members)
    membership = Membership(",".join(m.address for m in [victim, *others]), TTL_S)
    own_view = PrefixView(membership.client, "/test/")
    observer = connect(",".join(m.address for m in others))
    observed = PrefixView(observer, "/test/")
    tasks = [asyncio.create_task(loop) for loop in [*membership.hold("/test/held", b"1"), own_view.run(),
                                                     observed.run()]]
    try:
        async with asyncio.timeout(20):
            await observed.wait_for(lambda items: "/test/held" in items)
        assert membership.client.endpoint == victim.address  # it talks to the first, the one that fails
        lease = (await observer.get(b"/test/held")).lease

        victim.signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        await observer.put(b"/test/put-by-another", b"3")
        async with asyncio.timeout(20):  # its watch goes on through another member
            await own_view.wait_for(lambda items: "/test/put-by-another" in items)
        await membership.update("/test/written-after", b"2")
        async with asyncio.timeout(20):
            await observed.wait_for(lambda items: "/test/written-after" in items)
        assert membership.client.endpoint != victim.address
        # Kept alive through the move: the key was never dropped and put again under a new lease.
        assert (await observer.get(b"/test/held")).lease == lease
        assert (await observer.get(b"/test/written-after")).lease == lease
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await membership.client.close()
        await observer.close()


async def test_a_client_whose_first_member_is_down_uses_another(members: list[ManagedProcess]) -> None:
    victim, *others = await follower_first(members)
    victim.signal(signal.SIGKILL)
    client = connect(",".join(m.address for m in [victim, *others]))
    try:
        with pytest.raises(aetcd.exceptions.ConnectionFailedError):  # the first call meets the dead member
            await client.put(b"/test/key", b"value")
        await client.put(b"/test/key", b"value")  # the second goes to another
        assert (await client.get(b"/test/key")).value == b"value"
        assert client.endpoint != victim.address
    finally:
        await client.close()


async def test_a_lease_kept_alive_on_a_frozen_member_moves_to_the_next(members: list[ManagedProcess]) -> None:
    """A keep-alive (a stream) that timed out did not move the client: a node whose member froze while its lease's
    keep-alive was its only call to etcd left the fleet (the compose test's paused member)."""
    victim, *others = await follower_first(members)
    client = connect(",".join(m.address for m in [victim, *others]))
    try:
        lease = await client.lease(TTL_S)
        victim.signal(signal.SIGSTOP)
        with pytest.raises(aetcd.exceptions.ConnectionTimeoutError):
            await client.refresh_lease(lease.id, ttl_s=TTL_S)  # within a quarter of the TTL
        assert client.endpoint == others[0].address
        assert (await client.refresh_lease(lease.id, ttl_s=TTL_S)).TTL > 0  # the lease lives on
    finally:
        await client.close()


async def test_a_standby_keeps_its_place_in_the_election_when_its_member_dies(members: list[ManagedProcess]) -> None:
    """Its campaign watched the key before its own on the member that died: the watch broke, and the campaign failed
    and gave up its place (a broken watch; after the move, aetcd's cancel of it raised AttributeError: helper-178)."""
    victim, *others = await follower_first(members)
    leader_client = connect(",".join(m.address for m in others))
    standby_client = connect(",".join(m.address for m in [victim, *others]))
    leader, standby = Election(leader_client, "/test/election/", TTL_S), Election(standby_client, "/test/election/",
                                                                                TTL_S)
    loops = [asyncio.create_task(leader.keep_alive()), asyncio.create_task(standby.keep_alive())]
    try:
        await leader.campaign(b"leader")
        campaign = asyncio.create_task(standby.campaign(b"standby"))
        # Its key is written; it waits for the leader's to go.
        await eventually(lambda: standby.candidate_key is not None, 20, "the standby's key")
        place = standby.candidate_key

        victim.signal(signal.SIGKILL)
        # Its keep-alive or its watch moves it.
        await eventually(lambda: standby_client.endpoint != victim.address, 20, "the standby's client to move")
        assert not campaign.done(), campaign
        await leader.resign()
        async with asyncio.timeout(20):
            elected = await campaign
        assert elected.key == place
    finally:
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        await leader_client.close()
        await standby_client.close()
