"""Leader election in etcd, after etcd's client/v3/concurrency recipe.

Each candidate puts a key under the election prefix, attached to its own lease. The candidate
whose key has the lowest create revision leads; the others wait for the key just below theirs
to be deleted. Leadership is the pair (key, create revision) held in etcd — never a local flag:
every write the leader makes is a transaction that checks that pair, so a deposed leader's
writes fail. Resigning revokes the lease, which deletes the key and wakes the next candidate.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aetcd

log = logging.getLogger(__name__)


class NotLeader(Exception):
    """A fenced write was refused: this candidate's leadership key no longer stands."""


@dataclass(frozen=True)
class Leadership:
    """Proof of leadership: the candidate's key and its create revision."""

    key: str
    revision: int
    lease_id: int


class Election:
    """One candidate in the election under prefix."""

    def __init__(self, client: aetcd.Client, prefix: str, ttl_s: int) -> None:
        self._client = client
        self._prefix = prefix
        self._ttl_s = ttl_s
        self._leadership: Leadership | None = None
        # This candidate's key while it campaigns or leads.
        self._candidate: Leadership | None = None
        self.lost = asyncio.Event()

    @property
    def leadership(self) -> Leadership | None:
        return self._leadership

    async def campaign(self, value: bytes) -> Leadership:
        """Join the election and return once this candidate leads (run keep_alive alongside)."""
        lease = await self._client.lease(self._ttl_s)
        key = f"{self._prefix}{lease.id:016x}"
        tx = self._client.transactions
        created, _ = await self._client.transaction(
            compare=[tx.create(key.encode()) == 0],
            success=[tx.put(key.encode(), value, lease=lease.id)],
            failure=[],
        )
        if not created:
            raise RuntimeError(f"election key {key} already exists")
        revision = (await self._client.get(key.encode())).create_revision
        self._leadership = None
        self.lost.clear()
        self._candidate = Leadership(key, revision, lease.id)
        try:
            await self._wait_for_predecessors(revision)
        except BaseException:
            await self._revoke(lease.id)
            raise
        self._leadership = self._candidate
        log.info("elected: %s at revision %d", key, revision)
        return self._leadership

    async def _wait_for_predecessors(self, revision: int) -> None:
        """Until no key under the prefix was created before ours."""
        while True:
            listing = await self._client.get_prefix(self._prefix.encode())
            earlier = [kv for kv in listing if kv.create_revision < revision]
            if not earlier:
                return
            predecessor = max(earlier, key=lambda kv: kv.create_revision)
            watch = await self._client.watch(predecessor.key, start_revision=listing.header.revision + 1)
            try:
                async for event in watch:
                    if event.kind == "DELETE":
                        break
            finally:
                await watch.cancel()

    async def keep_alive(self) -> None:
        """Refresh the candidate's lease; set `lost` once etcd says it is gone.

        etcd being unreachable is not a loss: the leader keeps leading on its last view, and
        its fenced writes would fail if another had been elected meanwhile.
        """
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            candidate = self._candidate
            if candidate is None:
                continue
            try:
                reply = await self._client.refresh_lease(candidate.lease_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd down: keep the last view
                log.warning("election keep-alive failed (%s); still %s", exc,
                            "leading" if self._leadership else "campaigning")
                continue
            if reply is None or reply.TTL <= 0:
                log.warning("election lease %x expired: leadership lost", candidate.lease_id)
                self._leadership = None
                self._candidate = None
                self.lost.set()

    async def fenced_put(self, key: str, value: bytes) -> None:
        """Write key=value only while this candidate's leadership key stands; NotLeader otherwise."""
        leadership = self._leadership
        if leadership is None:
            raise NotLeader("not the leader")
        tx = self._client.transactions
        succeeded, _ = await self._client.transaction(
            compare=[tx.create(leadership.key.encode()) == leadership.revision],
            success=[tx.put(key.encode(), value)],
            failure=[],
        )
        if not succeeded:
            self._leadership = None
            self.lost.set()
            raise NotLeader(f"leadership {leadership.key}@{leadership.revision} no longer stands")

    async def resign(self) -> None:
        """Give up leadership (or candidacy) at once; best effort."""
        candidate = self._candidate
        self._leadership = None
        self._candidate = None
        if candidate is not None:
            await self._revoke(candidate.lease_id)

    async def _revoke(self, lease_id: int) -> None:
        try:
            await asyncio.wait_for(self._client.revoke_lease(lease_id), 2.0)
        except Exception as exc:  # noqa: BLE001 - the lease expires anyway
            log.warning("election lease revoke failed: %s", exc)
