"""etcd membership: keys held under a kept-alive lease, and live views of key prefixes.

Both survive etcd outages: a lost lease is re-granted and its keys re-put when etcd
answers again; a broken watch is re-established from a fresh listing. Neither ever
exits the process.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import aetcd

from services.common import etcd_keys

log = logging.getLogger(__name__)

_RETRY_S = 0.5


# Reconnect quickly once etcd is back: gRPC's default backoff grows to two minutes.
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
}


def connect(endpoint: str, timeout_s: float = 2.0) -> aetcd.Client:
    """An etcd client for host:port (connection is lazy)."""
    host, _, port = endpoint.rpartition(":")
    return aetcd.Client(host=host, port=int(port), timeout=timeout_s, options=dict(_CHANNEL_OPTIONS))


class LeaseSession:
    """Keys put under one lease that is kept alive; re-granted and re-put after an outage."""

    def __init__(self, client: aetcd.Client, ttl_s: int) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._lease_id: int | None = None
        self._keys: dict[str, bytes] = {}
        self._stale = False
        self._closed = False  # revoked: nothing is put or granted again
        self._lock = asyncio.Lock()

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
                    await self._client.put(key.encode(), value, lease=self._lease_id)
            except Exception as exc:  # noqa: BLE001 - etcd down: keep serving, retry later
                self._stale = True  # keep_alive puts every key again
                log.warning("etcd put %s failed (%s); will retry", key, exc)

    async def _grant(self) -> None:
        self._stale = True  # until every key is put under the new lease
        lease = await self._client.lease(self._ttl_s)
        self._lease_id = lease.id
        for key, value in self._keys.items():
            await self._client.put(key.encode(), value, lease=lease.id)
        self._stale = False
        log.info("etcd lease %x granted with %d keys", lease.id, len(self._keys))

    async def keep_alive(self) -> None:
        """Refresh the lease every third of its TTL; never raises on etcd errors."""
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            try:
                async with self._lock:
                    if self._closed:
                        return
                    if self._lease_id is None:
                        await self._grant()
                        continue
                    reply = await self._client.refresh_lease(self._lease_id)
                    if reply is None or reply.TTL <= 0:
                        log.warning("etcd lease %x expired; re-registering", self._lease_id)
                        self._lease_id = None
                        await self._grant()
                    elif self._stale:  # a put failed while the lease lived on: etcd holds an old value
                        for key, value in self._keys.items():
                            await self._client.put(key.encode(), value, lease=self._lease_id)
                        self._stale = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd down: keep serving, retry
                log.warning("etcd keep-alive failed (%s); retrying", exc)

    async def revoke(self) -> None:
        """Drop the lease and so every key under it; best effort at shutdown."""
        async with self._lock:
            lease_id, self._lease_id = self._lease_id, None
            self._keys.clear()
            self._closed = True
        if lease_id is not None:
            try:
                await asyncio.wait_for(self._client.revoke_lease(lease_id), 2.0)
            except Exception as exc:  # noqa: BLE001 - the lease will expire anyway
                log.warning("etcd lease revoke failed: %s", exc)


class PrefixView:
    """A live copy of every key under a prefix, kept by list-then-watch."""

    def __init__(
        self,
        client: aetcd.Client,
        prefix: str,
        on_change: Callable[[dict[str, bytes]], None] | None = None,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._on_change = on_change
        self.items: dict[str, bytes] = {}
        # Each key's create revision: the order keys were created in (an election's queue).
        self.create_revisions: dict[str, int] = {}
        self.synced = asyncio.Event()
        self._changed = asyncio.Condition()

    async def run(self) -> None:
        """List, then watch from the listing's revision; relist after any error."""
        while True:
            try:
                await self._list_and_watch()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd down: keep the last view, retry
                log.warning("etcd watch on %s failed (%s); keeping last view", self._prefix, exc)
                await asyncio.sleep(_RETRY_S)

    async def _list_and_watch(self) -> None:
        listing = await self._client.get_prefix(self._prefix.encode())
        self.create_revisions = {kv.key.decode(): kv.create_revision for kv in listing}
        await self._replace({kv.key.decode(): kv.value for kv in listing})
        watch = await self._client.watch_prefix(
            self._prefix.encode(), start_revision=listing.header.revision + 1
        )
        try:
            async for event in watch:
                key = event.kv.key.decode()
                items = dict(self.items)
                if event.kind == "PUT":
                    items[key] = event.kv.value
                    self.create_revisions[key] = event.kv.create_revision
                else:
                    items.pop(key, None)
                    self.create_revisions.pop(key, None)
                await self._replace(items)
        finally:
            try:
                await watch.cancel()
            except Exception:  # noqa: BLE001 - the stream is already gone
                pass

    async def _replace(self, items: dict[str, bytes]) -> None:
        self.items = items
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

    def __init__(self, endpoint: str, ttl_s: int) -> None:
        self.client = connect(endpoint)
        self._session = LeaseSession(self.client, ttl_s)

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
