"""This node's load, streamed to the scheduler on every change and at a fixed interval."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from baton.v1 import common_pb2, scheduler_pb2_grpc
from services.common.change_signal import wait_or_timeout
from services.common.directory import ServiceDirectory, for_each_instance
from services.common.load import load_to_proto
from services.node_agent.model_host import ModelHost

log = logging.getLogger(__name__)

_RETRY_S = 0.5


def load_message(node_id: str, host: ModelHost) -> common_pb2.NodeLoad:
    return load_to_proto(node_id, host.load(), reported_at_ms=int(time.time() * 1000))


async def report_load(node_id: str, host: ModelHost, schedulers: ServiceDirectory, interval_s: float) -> None:
    """Keep a ReportLoad stream open to every scheduler replica, so a standby that takes over
    already knows the fleet's load."""

    async def reports() -> AsyncIterator[common_pb2.NodeLoad]:
        while True:
            changed = host.load_changed.since_now()
            yield load_message(node_id, host)
            # A change is reported at once; otherwise a heartbeat every interval.
            await wait_or_timeout(changed, interval_s)

    async def report_to(address: str) -> None:
        stub = scheduler_pb2_grpc.SchedulerStub(schedulers.channel(address))
        while True:
            try:
                await stub.ReportLoad(reports())
            except grpc.aio.AioRpcError as exc:
                log.warning("load stream to %s broke: %s", address, exc.code().name)
            await asyncio.sleep(_RETRY_S)

    await for_each_instance(schedulers, report_to)
