"""Find service instances registered in etcd and keep one channel per address."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import aetcd
import grpc

from services.common import etcd_keys
from services.common.etcd_session import PrefixView
from services.common.telemetry import Telemetry

log = logging.getLogger(__name__)


class ChannelPool:
    """One traced channel per address, reused by every call to it."""

    def __init__(self, telemetry: Telemetry) -> None:
        self._telemetry = telemetry
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = self._telemetry.insecure_channel(address)
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
        for _, value in sorted(self._view.items.items()):
            try:
                result.append(json.loads(value)["address"])
            except (ValueError, KeyError):
                log.warning("malformed %s registration: %r", self.kind, value)
        return result

    def channel(self, address: str) -> grpc.aio.Channel:
        return self._channels.get(address)

    async def wait_changed(self, addresses: set[str]) -> None:
        """Until the registered addresses differ from addresses."""
        await self._view.wait_for(lambda _: set(self.addresses()) != addresses)

    async def close(self) -> None:
        await self._channels.close()


class LeaderDirectory:
    """The elected leader of a service kind, as its election prefix in etcd shows it."""

    def __init__(self, client: aetcd.Client, election_prefix: str, telemetry: Telemetry) -> None:
        self._view = PrefixView(client, election_prefix)
        self._channels = ChannelPool(telemetry)

    async def run(self) -> None:
        await self._view.run()

    def address(self) -> str | None:
        first = self._view.first()
        return None if first is None else json.loads(first[1])["address"]

    def channel(self, address: str) -> grpc.aio.Channel:
        return self._channels.get(address)

    async def wait_for_other(self, address: str | None, timeout_s: float) -> str | None:
        """A leader other than address, once etcd shows one; None after timeout_s."""

        def has_other(_: dict[str, bytes]) -> bool:
            current = self.address()
            return current is not None and current != address

        try:
            await asyncio.wait_for(self._view.wait_for(has_other), timeout_s)
        except TimeoutError:
            return None
        return self.address()

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
