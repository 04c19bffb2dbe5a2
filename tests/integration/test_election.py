"""Leader election on a real etcd: who leads, hand-over on resignation and expiry, fenced writes."""

from __future__ import annotations

import asyncio
import json

import pytest

from baton.cluster import ManagedProcess
from services.common import etcd_keys
from services.common.election import Election, NotLeader
from services.common.etcd_session import connect
from services.scheduler.leadership import LeaderRole

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PREFIX = "/test/election/"


async def test_the_first_candidate_leads_and_the_next_takes_over_when_it_resigns(etcd: ManagedProcess) -> None:
    first, second = connect(etcd.address), connect(etcd.address)
    a, b = Election(first, PREFIX, ttl_s=2), Election(second, PREFIX, ttl_s=2)
    keep_alive = [asyncio.create_task(a.keep_alive()), asyncio.create_task(b.keep_alive())]
    try:
        leading = await asyncio.wait_for(a.campaign(b"a"), 5)
        waiting = asyncio.create_task(b.campaign(b"b"))
        async with asyncio.timeout(5):
            while len(await first.get_prefix(PREFIX.encode())) < 2:  # b has queued up behind a
                await asyncio.sleep(0.02)
        assert not waiting.done() and b.leadership is None, "only one candidate leads"

        await a.resign()
        successor = await asyncio.wait_for(waiting, 5)
        assert successor.revision > leading.revision
        assert b.leadership == successor and a.leadership is None
    finally:
        for task in keep_alive:
            task.cancel()
        await b.resign()
        await first.close()
        await second.close()


async def test_a_deposed_leaders_write_is_rejected(etcd: ManagedProcess) -> None:
    first, second = connect(etcd.address), connect(etcd.address)
    old, new = Election(first, PREFIX, ttl_s=2), Election(second, PREFIX, ttl_s=2)
    try:
        deposed = await old.campaign(b"old")
        await old.fenced_put("/test/state", b"written by the old leader")
        # The old leader's lease ends behind its back (as when it was partitioned from etcd).
        await second.revoke_lease(deposed.lease_id)
        await asyncio.wait_for(new.campaign(b"new"), 5)
        await new.fenced_put("/test/state", b"written by the new leader")

        with pytest.raises(NotLeader):
            await old.fenced_put("/test/state", b"a stale write")
        assert (await second.get(b"/test/state")).value == b"written by the new leader"
        assert old.lost.is_set() and old.leadership is None
    finally:
        await new.resign()
        await first.close()
        await second.close()


async def test_a_leader_whose_lease_expired_learns_it_from_keep_alive(etcd: ManagedProcess) -> None:
    client = connect(etcd.address)
    election = Election(client, PREFIX, ttl_s=1)
    try:
        leadership = await election.campaign(b"me")
        await client.revoke_lease(leadership.lease_id)
        keep_alive = asyncio.create_task(election.keep_alive())
        await asyncio.wait_for(election.lost.wait(), 5)
        keep_alive.cancel()
        assert election.leadership is None
    finally:
        await client.close()


async def test_a_candidate_whose_key_expired_while_it_waited_is_not_elected(etcd: ManagedProcess) -> None:
    clients = [connect(etcd.address) for _ in range(3)]
    a, b, c = (Election(client, PREFIX, ttl_s=2) for client in clients)
    waiting: list[asyncio.Task[object]] = []
    try:
        leading = await asyncio.wait_for(a.campaign(b"a"), 5)
        waiting.append(asyncio.create_task(b.campaign(b"b")))
        async with asyncio.timeout(5):
            while len(listing := await clients[0].get_prefix(PREFIX.encode())) < 2:
                await asyncio.sleep(0.02)
        # b's lease ends while it waits behind a (as when etcd froze for longer than the TTL) ...
        b_key = next(kv.key.decode() for kv in listing if kv.key.decode() != leading.key)
        await clients[0].revoke_lease(int(b_key.removeprefix(PREFIX), 16))
        # ... and c queues up after it.
        waiting.append(asyncio.create_task(c.campaign(b"c")))
        async with asyncio.timeout(5):
            while len(await clients[0].get_prefix(PREFIX.encode())) < 2:
                await asyncio.sleep(0.02)

        await a.resign()
        successor = await asyncio.wait_for(waiting[1], 5)
        with pytest.raises(NotLeader):
            await asyncio.wait_for(waiting[0], 5)
        assert c.leadership == successor and b.leadership is None, "one leader: the candidate whose key stands"
    finally:
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await c.resign()
        for client in clients:
            await client.close()


async def test_a_leader_that_resigns_writes_its_state_once_more_as_it_stands_when_it_no_longer_acts(
        etcd: ManagedProcess) -> None:
    """A scheduler leader stopped between its periodic state writes lost up to a second of the ledger's updates,
    whose notices it had acknowledged (helper-194). Its last write is made of the state once nothing more is done as
    leader, and is fenced: a deposed leader's is refused."""
    client = connect(etcd.address)
    leader = Election(client, PREFIX, ttl_s=2)
    try:
        await leader.campaign(b"leader")
        await leader.fenced_put("/test/resigned-state", b"the last periodic write")
        leading_when_read = []

        def last_state() -> tuple[str, bytes]:
            leading_when_read.append(leader.is_leading())
            return "/test/resigned-state", b"as it stood at the resignation"

        await leader.resign(last_state)
        assert leading_when_read == [False]
        assert (await client.get(b"/test/resigned-state")).value == b"as it stood at the resignation"

        deposed = Election(client, PREFIX, ttl_s=2)
        leadership = await deposed.campaign(b"deposed")
        await client.revoke_lease(leadership.lease_id)  # its key gone behind its back
        await deposed.resign(lambda: ("/test/resigned-state", b"a deposed leader's"))
        assert (await client.get(b"/test/resigned-state")).value == b"as it stood at the resignation"
    finally:
        await client.close()


async def test_a_scheduler_that_resigns_writes_its_state_and_campaigns_no_more(etcd: ManagedProcess) -> None:
    """Resigned on SIGTERM, a scheduler alone campaigned again while its last calls drained, led again within a
    second, and its later updates were never written (helper-198)."""
    client = connect(etcd.address)
    state = {"acked": 0}
    role = LeaderRole(client, "s1", "127.0.0.1:1", 3, save_state=lambda: dict(state),
                      restore_state=state.update, persist_interval_s=60.0)
    campaign, *others = [asyncio.create_task(loop) for loop in role.loops()]
    try:
        await asyncio.wait_for(role.elected.wait(), 10)
        state["acked"] = 5  # after the last periodic write (none in 60 s)
        await role.resign()
        stored = await client.get(etcd_keys.SCHEDULER_STATE.encode())
        assert stored is not None and json.loads(stored.value) == {"acked": 5}
        await asyncio.wait_for(campaign, 10)  # it stops campaigning
        assert not role.is_leader and not await client.get_prefix(etcd_keys.SCHEDULER_ELECTION.encode())
    finally:
        for task in (campaign, *others):
            task.cancel()
        await asyncio.gather(campaign, *others, return_exceptions=True)
        await client.close()


async def test_a_scheduler_that_resigns_while_taking_over_leaves_its_predecessors_state(etcd: ManagedProcess) -> None:
    """In a rolling restart, a successor stopped while it read its predecessor's hand-over wrote its own empty state
    over it, and the next one restored nothing (helper-199)."""
    first_client, second_client = connect(etcd.address), connect(etcd.address)
    reading, release = asyncio.Event(), asyncio.Event()
    real_get = second_client.get

    async def held_get(key: bytes, *args: object, **kwargs: object) -> object:
        if key == etcd_keys.SCHEDULER_STATE.encode():
            reading.set()
            await release.wait()
        return await real_get(key, *args, **kwargs)

    second_client.get = held_get  # type: ignore[method-assign]
    first_state, second_state = {"n": 5}, {}
    first = LeaderRole(first_client, "s1", "127.0.0.1:1", 3, save_state=lambda: dict(first_state),
                       restore_state=first_state.update)
    second = LeaderRole(second_client, "s2", "127.0.0.1:2", 3, save_state=lambda: dict(second_state),
                        restore_state=second_state.update)
    tasks = [asyncio.create_task(loop) for loop in first.loops()]
    try:
        await asyncio.wait_for(first.elected.wait(), 10)
        second_campaign, *others = [asyncio.create_task(loop) for loop in second.loops()]
        tasks += [second_campaign, *others]
        await first.resign()
        await asyncio.wait_for(reading.wait(), 10)  # the second is elected and reads the hand-over
        await second.resign()
        release.set()
        await asyncio.wait_for(second_campaign, 10)
        stored = await first_client.get(etcd_keys.SCHEDULER_STATE.encode())
        assert stored is not None and json.loads(stored.value) == {"n": 5}
        assert not second.elected.is_set() and not await first_client.get_prefix(
            etcd_keys.SCHEDULER_ELECTION.encode())
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await first_client.close()
        await second_client.close()
