"""etcd membership: keys held under a kept-alive lease, and live views of key prefixes.

Both survive etcd outages: a lost lease is re-granted and its keys re-put as soon as etcd
answers again; a broken watch is re-established from a fresh listing; a view can hold keys
whose lease lapsed for a grace period, so that an etcd freeze, which expires every lease at
once, takes no live process out of it. Neither ever exits the process. docs/etcd.md states
the guarantee.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import aetcd
import grpc

from services.common import etcd_keys
from services.common.change_signal import ChangeSignal, wait_or_timeout
from services.common.etcd_client import EtcdClient, split_endpoints
from services.common.lapsed_keys import LapsedKeys
from services.common.repeats import Repeats
from services.common.timeouts import within

log = logging.getLogger(__name__)

_RETRY_S = 0.5
# Keep-alive retry after a failure: short, so a lease that lapsed while etcd was frozen is
# re-granted within a moment of etcd answering again.
QUICK_RETRY_S = 0.2


def connect(endpoints: str, timeout_s: float = 2.0, credentials: grpc.ChannelCredentials | None = None) -> EtcdClient:
    """An etcd client for host:port, or for several members' host:port comma-separated (connection is lazy); over
    TLS with credentials."""
    return EtcdClient(split_endpoints(endpoints), timeout_s, credentials)


class _LeaseOf(aetcd.transactions.BaseCompare):
    """The lease a key is attached to (0 for none, or no such key): a compare aetcd does not offer."""

    def build_compare(self, compare: aetcd.rpc.Compare) -> None:
        compare.target = aetcd.rpc.Compare.LEASE
        compare.lease = int(self.value)


class LeaseSession:
    """Keys put under one lease that is kept alive; re-granted and re-put after an outage.

    A key's first put takes it over, whoever held it: a process started in the place of another (a node agent
    restarted under its id) holds it from then on. Every later write (a changed value, a put again after an outage,
    the mark of leaving) is made only while the key is this session's own or no one's: the old process's leaving
    emptied the new one's key and revoked it with its own lease, and the new process was gone from the fleet for good,
    serving and healthy (helper-158). A key that another process took over is given up, not taken back (noticed at
    this session's next write, or at the keep-alive's check that each key is still its own): it is put again only
    once it is under no lease (its other holder gone), tried at every keep-alive, so that the one left of two holders
    whose leases both lapsed in an etcd freeze, the other re-registered first, comes back (helper-162), as does a
    node agent whose id another process took while it lived, once that one leaves (helper-196).
    """

    def __init__(self, client: aetcd.Client, ttl_s: int) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._lease_id: int | None = None
        self._keys: dict[str, bytes] = {}
        # The keys this session has written once: from then on, only while they are its own or no one's.
        self._taken: set[str] = set()
        # The keys another process took over: written only while under no lease.
        self._given_up: set[str] = set()
        self._stale = False
        self._closed = False  # revoked: nothing is put or granted again
        self._lock = asyncio.Lock()
        # Set once a key was first written under a lease: the process is in the fleet (it stays set through an
        # outage, in which the process serves on).
        self.registered = asyncio.Event()

    @property
    def lease_id(self) -> int | None:
        return self._lease_id

    async def put(self, key: str, value: bytes) -> None:
        """Hold key=value for as long as this session lives; while etcd is down, keep_alive retries."""
        async with self._lock:
            if self._closed:
                return
            self._keys[key] = value
            try:
                if self._lease_id is None:
                    await self._grant()
                else:
                    await self._write(key, value, self._lease_id)
            except Exception as exc:  # noqa: BLE001 - etcd down: keep serving, retry later
                self._stale = True  # keep_alive puts every key again
                log.warning("etcd put %s failed (%s); will retry", key, exc)

    async def _grant(self) -> None:
        self._stale = True  # until every key is put under the new lease
        lease = await self._client.lease(self._ttl_s)
        self._lease_id = lease.id
        for key, value in list(self._keys.items()):
            await self._write(key, value, lease.id)
        self._stale = False
        log.info("etcd lease %x granted with %d keys", lease.id, len(self._keys))

    async def keep_alive(self) -> None:
        """Refresh the lease every third of its TTL; never raises on etcd errors.

        After a failure it tries again within QUICK_RETRY_S rather than a third of the TTL, so
        that once etcd answers again a lapsed lease is re-granted and its keys re-put at once.
        """
        delay_s = self._ttl_s / 3
        failures, checks = Repeats(log), Repeats(log)
        while True:
            await asyncio.sleep(delay_s)
            delay_s = min(self._ttl_s / 3, QUICK_RETRY_S)
            try:
                async with self._lock:
                    if self._closed:
                        return
                    if self._lease_id is None:
                        await self._grant()
                    else:
                        reply = await self._client.refresh_lease(self._lease_id, ttl_s=self._ttl_s)
                        if reply is None or reply.TTL <= 0:
                            log.warning("etcd lease %x expired; re-registering", self._lease_id)
                            self._lease_id = None
                            await self._grant()
                        elif self._stale:  # a put failed while the lease lived on: etcd holds an old value
                            for key, value in list(self._keys.items()):
                                await self._write(key, value, self._lease_id)
                            self._stale = False
                        else:
                            await self._check_keys(self._lease_id, checks)
                delay_s = self._ttl_s / 3
                failures.succeeded("etcd keep-alive works again")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd down: keep serving, retry
                failures.failed("etcd keep-alive failed (%s); retrying every %.1f s", exc, delay_s)

    async def revoke(self) -> None:
        """Drop the lease and so every key under it; best effort at shutdown.

        Each key is first emptied: readers that hold lapsed keys for a grace period (PrefixView)
        drop an emptied one at once, so a clean exit leaves their views as fast as before.
        """
        async with self._lock:
            lease_id, self._lease_id = self._lease_id, None
            keys = list(self._keys)
            self._keys.clear()
            self._closed = True
        if lease_id is None:
            return
        try:
            await within(self._mark_leaving(lease_id, keys), 1.0)
        except Exception as exc:  # noqa: BLE001 - readers then hold the keys for their grace
            log.warning("etcd leaving mark failed: %s", exc)
        try:
            await within(self._client.revoke_lease(lease_id), 2.0)
        except Exception as exc:  # noqa: BLE001 - the lease will expire anyway
            log.warning("etcd lease revoke failed: %s", exc)

    async def _write(self, key: str, value: bytes, lease_id: int) -> None:
        """Put key=value under lease_id: the first time whoever holds it, then only while it is under lease_id or
        under none (its old lease expired with an etcd outage, say, or the process that took it over has gone); else
        another process holds it, and it is given up until then. Under the lock."""
        if key not in self._taken:
            await self._client.put(key.encode(), value, lease=lease_id)
            self._taken.add(key)
            self.registered.set()  # (also when a first write that failed is put again by keep_alive: helper-177)
            return
        for holder in (lease_id, 0):
            if await self._put_if_under(key, value, lease_id, holder):
                self.registered.set()
                if key in self._given_up:
                    self._given_up.discard(key)
                    log.info("etcd key %s: the process that took it over has gone; holding it again", key)
                return
        if key not in self._given_up:
            stored = await self._client.get(key.encode())
            log.warning("etcd key %s is held by another process now (lease %x): it took this one's place; no longer "
                        "holding it", key, stored.lease if stored is not None else 0)
            self._given_up.add(key)

    async def _check_keys(self, lease_id: int, checks: Repeats) -> None:
        """Each key is still this session's: one another process took over since this one last wrote it is given up,
        and one given up, or deleted meanwhile, is put again if under no lease. A process that took a node's id
        while its agent lived, then left, deleted the key, and the agent, which had nothing new to write, never
        noticed: it was gone from the fleet for good, serving and healthy (helper-196). Reads that fail are not the
        keep-alive's failure (the lease lives): the keys are read again at the next keep-alive, a third of the TTL on
        (said as "keep-alive failed", a live lease was refreshed every QUICK_RETRY_S, helper-198); a put back that
        fails is, and is tried again soon. Under the lock."""
        try:
            stale = await self._keys_to_put(lease_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - etcd refreshed the lease but did not answer the reads
            checks.failed("etcd lease %x kept alive, but its keys could not be checked (%s); checking them again at "
                          "the next keep-alive", lease_id, exc)
            return
        checks.succeeded("etcd lease %x: its keys are checked again", lease_id)
        for key in stale:
            await self._write(key, self._keys[key], lease_id)

    async def _keys_to_put(self, lease_id: int) -> list[str]:
        """The keys not under lease_id in etcd now: given up, taken over since, or deleted. Under the lock."""
        stale = []
        for key in list(self._keys):
            if key in self._taken and key not in self._given_up:
                stored = await self._client.get(key.encode())
                if stored is not None and stored.lease == lease_id:
                    continue
                if stored is None:
                    log.warning("etcd key %s was deleted by another process; putting it back", key)
            stale.append(key)
        return stale

    async def _put_if_under(self, key: str, value: bytes, lease_id: int, holder: int) -> bool:
        """Put key=value under lease_id if the key is now under the lease holder (0: none, or no such key)."""
        written, _ = await self._client.transaction(
            compare=[_LeaseOf(key.encode()) == holder],
            success=[self._client.transactions.put(key.encode(), value, lease=lease_id)], failure=[])
        return bool(written)

    async def _mark_leaving(self, lease_id: int, keys: list[str]) -> None:
        tx = self._client.transactions
        for key in keys:  # not one another process took over: its holder is not leaving
            await self._client.transaction(compare=[_LeaseOf(key.encode()) == lease_id],
                                           success=[tx.put(key.encode(), b"", lease=lease_id)], failure=[])


class PrefixView:
    """A live copy of every key under a prefix, kept by list-then-watch.

    With grace_s > 0 a key that vanishes (its lease lapsed, or was revoked) stays in `items` for
    grace_s, listed in `lapsed`, unless its holder put it back meanwhile; a key whose holder
    marked it as leaving (an empty value, see LeaseSession.revoke) goes at once.
    """

    def __init__(
        self,
        client: aetcd.Client,
        prefix: str,
        on_change: Callable[[dict[str, bytes]], None] | None = None,
        grace_s: float = 0.0,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._on_change = on_change
        self._present: dict[str, bytes] = {}
        self._held = LapsedKeys(grace_s)
        self._held_changed = ChangeSignal()
        self.items: dict[str, bytes] = {}
        # Keys in items that etcd no longer lists, held until their grace ends.
        self.lapsed: frozenset[str] = frozenset()
        # Each key's create revision: the order keys were created in (an election's queue).
        self.create_revisions: dict[str, int] = {}
        self.synced = asyncio.Event()
        self._changed = asyncio.Condition()
        self._failures = Repeats(log)

    async def run(self) -> None:
        """List, then watch from the listing's revision; relist after any error."""
        if self._held.grace_s <= 0:
            await self._watch_forever()
            return
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._watch_forever())
            tasks.create_task(self._end_graces())

    async def _watch_forever(self) -> None:
        while True:
            try:
                await self._list_and_watch()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd down: keep the last view, retry
                self._failures.failed("etcd watch on %s failed (%s); %s", self._prefix, exc,
                                      "keeping the last view" if self.synced.is_set() else "no view yet")
                await asyncio.sleep(_RETRY_S)

    async def _list_and_watch(self) -> None:
        # Keys are decoded leniently: one not UTF-8 (no Baton process writes one) failed every listing, and the view
        # stayed as it was for good (helper-183); its reader skips its value as it would any it cannot use.
        listing = await self._client.get_prefix(self._prefix.encode())
        self.create_revisions.update((kv.key.decode(errors="replace"), kv.create_revision) for kv in listing)
        self._present = {kv.key.decode(errors="replace"): kv.value for kv in listing if kv.value}
        await self._publish(frozenset(kv.key.decode(errors="replace") for kv in listing if not kv.value))
        watch = await self._client.watch_prefix(
            self._prefix.encode(), start_revision=listing.header.revision + 1
        )
        self._failures.succeeded("etcd watch on %s listed and watching again", self._prefix)
        try:
            async for event in watch:
                key = event.kv.key.decode(errors="replace")
                leaving: frozenset[str] = frozenset()
                if event.kind == "PUT" and event.kv.value:
                    self._present[key] = event.kv.value
                    self.create_revisions[key] = event.kv.create_revision
                else:
                    self._present.pop(key, None)
                    if event.kind == "PUT":  # emptied by its holder on the way out
                        leaving = frozenset((key,))
                await self._publish(leaving)
        finally:
            try:
                await watch.cancel()
            except Exception:  # noqa: BLE001 - the stream is already gone
                pass

    async def _end_graces(self) -> None:
        """Drop each lapsed key when its grace ends."""
        loop = asyncio.get_running_loop()
        while True:
            changed = self._held_changed.since_now()
            expiry = self._held.next_expiry()
            if expiry is None:
                await changed.wait()
            elif not await wait_or_timeout(changed, max(0.0, expiry - loop.time())):
                if ended := self._held.expire(loop.time()):
                    # Named: a node that died showed only as "keys under /baton/nodes/" in every service's log.
                    log.warning("etcd keys under %s did not come back within %.1f s: %s", self._prefix,
                                self._held.grace_s, ", ".join(key.removeprefix(self._prefix) for key in sorted(ended)))
                    await self._replace(self._held.view())

    async def _publish(self, leaving: frozenset[str]) -> None:
        self._held.update(self._present, asyncio.get_running_loop().time(), leaving)
        self._held_changed.notify()
        await self._replace(self._held.view())

    async def _replace(self, items: dict[str, bytes]) -> None:
        self.items = items
        self.lapsed = self._held.lapsed()
        self.create_revisions = {key: self.create_revisions.get(key, 0) for key in items}
        self.synced.set()
        if self._on_change is not None:
            self._on_change(items)
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, predicate: Callable[[dict[str, bytes]], bool]) -> None:
        """Wait until predicate(items) holds."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.synced.is_set() and predicate(self.items))

    def first(self) -> tuple[str, bytes] | None:
        """The key created earliest (lowest create revision) and its value; None when empty."""
        if not self.items:
            return None
        key = min(self.items, key=lambda k: self.create_revisions.get(k, 0))
        return key, self.items[key]


class Membership:
    """This process's etcd client and the keys it holds there under one kept-alive lease."""

    def __init__(self, endpoint: str, ttl_s: int, credentials: grpc.ChannelCredentials | None = None) -> None:
        self.client = connect(endpoint, credentials=credentials)
        self._session = LeaseSession(self.client, ttl_s)

    @property
    def registered(self) -> asyncio.Event:
        """Set once the held keys were first written to etcd."""
        return self._session.registered

    def hold(self, key: str, value: bytes) -> list[Coroutine[Any, Any, None]]:
        """Loops that put key=value under the lease and keep the lease alive."""
        return [self._session.put(key, value), self._session.keep_alive()]

    async def update(self, key: str, value: bytes) -> None:
        """Replace the value of a key held under the lease."""
        await self._session.put(key, value)

    def hold_service(self, kind: str, instance_id: str, address: str) -> list[Coroutine[Any, Any, None]]:
        """hold() for a service instance's registration, found by ServiceDirectory."""
        value = json.dumps({"address": address}).encode()
        return self.hold(etcd_keys.service_key(kind, instance_id), value)

    async def leave(self) -> None:
        """Revoke the lease, so every key it holds goes at once."""
        await self._session.revoke()

    async def close(self) -> None:
        await self.client.close()
