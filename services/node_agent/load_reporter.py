"""This node's load, streamed to the scheduler on every change and at a fixed interval."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from baton.v1 import common_pb2, scheduler_pb2_grpc
from services.common.directory import ServiceDirectory
from services.node_agent.engines.base import Engine

log = logging.getLogger(__name__)

_RETRY_S = 0.5


def load_message(node_id: str, engine: Engine) -> common_pb2.NodeLoad:
    load = engine.load()
    return common_pb2.NodeLoad(
        node_id=node_id,
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        kv_blocks_used=load.kv_blocks_used,
        kv_blocks_total=load.kv_blocks_total,
        active_decode_blocks=load.active_decode_blocks,
        pending_prefill_tokens=load.pending_prefill_tokens,
        reported_at_ms=int(time.time() * 1000),
    )


async def report_load(node_id: str, engine: Engine, schedulers: ServiceDirectory, interval_s: float) -> None:
    """Keep a ReportLoad stream open to a registered scheduler; reconnect after errors."""

    async def reports() -> AsyncIterator[common_pb2.NodeLoad]:
        while True:
            engine.load_changed.clear()
            yield load_message(node_id, engine)
            # A change is reported at once; otherwise a heartbeat every interval.
            try:
                await asyncio.wait_for(engine.load_changed.wait(), interval_s)
            except TimeoutError:
                pass

    while True:
        addresses = schedulers.addresses() or await schedulers.wait_any(timeout_s=3600)
        for address in addresses:
            stub = scheduler_pb2_grpc.SchedulerStub(schedulers.channel(address))
            try:
                await stub.ReportLoad(reports())
            except grpc.aio.AioRpcError as exc:
                log.warning("load stream to %s broke: %s", address, exc.code().name)
        await asyncio.sleep(_RETRY_S)
