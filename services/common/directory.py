"""Find service instances registered in etcd and keep one channel per address."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aetcd
import grpc

from services.common import etcd_keys
from services.common.etcd_records import address_of
from services.common.etcd_session import PrefixView
from services.common.reconnect import RECONNECT_OPTIONS
from services.common.telemetry import Telemetry
from services.common.timeouts import within

log = logging.getLogger(__name__)


class ChannelPool:
    """One traced channel per address, reused by every call to it, quick to reconnect to a restarted peer."""

    def __init__(self, telemetry: Telemetry) -> None:
        self._telemetry = telemetry
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = self._telemetry.channel(address, RECONNECT_OPTIONS)
        return self._channels[address]

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


class ServiceDirectory:
    """Instances of one service kind ("scheduler", "kvindex") as etcd lists them."""

    def __init__(self, client: aetcd.Client, kind: str, telemetry: Telemetry, grace_s: float = 0.0) -> None:
        self.kind = kind
        # grace_s: how long an instance whose lease lapsed is still listed (PrefixView).
        self._view = PrefixView(client, etcd_keys.service_prefix(kind), grace_s=grace_s)
        self._channels = ChannelPool(telemetry)

    async def run(self) -> None:
        await self._view.run()

    def addresses(self) -> list[str]:
        """Addresses of the registered instances, in instance-id order."""
        result = []
        for key, value in sorted(self._view.items.items()):
            try:
                result.append(address_of(value))
            except ValueError as exc:
                log.warning("malformed %s registration at %s: %s", self.kind, key, exc)
        return result

    def channel(self, address: str) -> grpc.aio.Channel:
        return self._channels.get(address)

    async def wait_changed(self, addresses: set[str]) -> None:
        """Until the registered addresses differ from addresses."""
        await self._view.wait_for(lambda _: set(self.addresses()) != addresses)

    async def close(self) -> None:
        await self._channels.close()


@dataclass(frozen=True)
class LeaderRecord:
    """A leader as its election shows it: the key, its create revision, and the address it serves at."""

    key: str
    revision: int
    address: str


class LeaderDirectory:
    """The elected leader of a service kind, as its election prefix in etcd shows it.

    A leader is known by its election key and that key's create revision, never by its
    address alone: a replica restarted on the same port and elected again is a new leader.
    """

    def __init__(self, client: aetcd.Client, election_prefix: str, telemetry: Telemetry) -> None:
        self._view = PrefixView(client, election_prefix)
        self._channels = ChannelPool(telemetry)

    async def run(self) -> None:
        await self._view.run()

    def leader(self) -> LeaderRecord | None:
        first = self._view.first()
        if first is None:
            return None
        key, value = first
        try:
            address = address_of(value)
        except ValueError as exc:
            log.warning("malformed leader record at %s: %s", key, exc)
            return None
        return LeaderRecord(key, self._view.create_revisions.get(key, 0), address)

    def address(self) -> str | None:
        leader = self.leader()
        return None if leader is None else leader.address

    def channel(self, address: str) -> grpc.aio.Channel:
        return self._channels.get(address)

    async def wait_for_other(self, leader: LeaderRecord | None, timeout_s: float) -> LeaderRecord | None:
        """A leader other than leader (another key or revision, whatever its address) once etcd
        shows one; None after timeout_s."""

        def has_other(_: dict[str, bytes]) -> bool:
            current = self.leader()
            return current is not None and current != leader

        try:
            await within(self._view.wait_for(has_other), timeout_s)
        except TimeoutError:
            return None
        return self.leader()

    async def wait_other_or_reachable(self, leader: LeaderRecord, timeout_s: float) -> LeaderRecord | None:
        """After a call to leader failed in transport: another leader once etcd shows one, or leader
        again once its channel reconnects while etcd still shows it; None after timeout_s.

        A replica restarted in place serves before it campaigns: reachable while etcd shows no leader
        at all (the old key expired), it is waited for until etcd shows a leader."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        channel = self.channel(leader.address)
        if channel.get_state() == grpc.ChannelConnectivity.READY:  # connected, yet it failed: not a reconnect
            return await self.wait_for_other(leader, timeout_s)
        other = asyncio.ensure_future(self.wait_for_other(leader, timeout_s))
        reachable = asyncio.ensure_future(within(channel.channel_ready(), timeout_s))
        try:
            done, _ = await asyncio.wait({other, reachable}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            other.cancel()
            reachable.cancel()
        if other in done and not other.cancelled() and other.result() is not None:
            return other.result()
        if reachable in done and not reachable.cancelled() and reachable.exception() is None:
            return self.leader() or await self.wait_for_other(leader, max(0.0, end - loop.time()))
        return None

    async def wait_replaced(self, is_current: Callable[[LeaderRecord | None], bool]) -> None:
        """Until the leader etcd shows no longer passes is_current (it changed, or none leads)."""
        await self._view.wait_for(lambda _: not is_current(self.leader()))

    async def close(self) -> None:
        await self._channels.close()


async def for_each_instance(directory: ServiceDirectory, run: Callable[[str], Coroutine[Any, Any, None]]) -> None:
    """Keep one run(address) task per registered instance, started and cancelled as they come and go.

    run should loop until cancelled; if it ends or raises, it is started again when the
    instances next change.
    """
    tasks: dict[str, asyncio.Task[None]] = {}
    try:
        while True:
            addresses = set(directory.addresses())
            for address in [a for a in tasks if a not in addresses or tasks[a].done()]:
                task = tasks.pop(address)
                task.cancel()
                if not task.cancelled() and task.done() and task.exception() is not None:
                    log.error("%s loop for %s failed: %r", directory.kind, address, task.exception())
            for address in addresses - tasks.keys():
                tasks[address] = asyncio.create_task(run(address))
            await directory.wait_changed(addresses)
    finally:
        for task in tasks.values():
            task.cancel()
        if tasks:
            await asyncio.wait(tasks.values())
