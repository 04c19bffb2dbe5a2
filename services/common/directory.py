"""Find service instances registered in etcd and keep one channel per address."""

from __future__ import annotations

import asyncio
import json
import logging

import aetcd
import grpc

from services.common import etcd_keys
from services.common.errors import Unavailable
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

    def __init__(self, client: aetcd.Client, kind: str, telemetry: Telemetry) -> None:
        self.kind = kind
        self._view = PrefixView(client, etcd_keys.service_prefix(kind))
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

    async def wait_any(self, timeout_s: float) -> list[str]:
        """Addresses once at least one instance is registered; Unavailable after timeout_s."""
        try:
            await asyncio.wait_for(self._view.wait_for(lambda items: bool(items)), timeout_s)
        except TimeoutError:
            raise Unavailable(f"no {self.kind} is registered in etcd") from None
        return self.addresses()

    async def close(self) -> None:
        await self._channels.close()
