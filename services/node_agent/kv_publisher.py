"""Numbered batches of this node's KV events, streamed to every kvindex replica."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator

import grpc

from baton.v1 import kvindex_pb2, kvindex_pb2_grpc
from services.common.directory import ServiceDirectory
from services.kvindex.servicer import event_to_proto
from services.node_agent.engines.base import Engine

log = logging.getLogger(__name__)

_RETRY_S = 0.5


class KvEventLog:
    """The recent batches, numbered from 1, each publisher reading at its own cursor."""

    def __init__(self, node_id: str, model: str, capacity: int = 10_000) -> None:
        self._node_id = node_id
        self._model = model
        self._batches: deque[kvindex_pb2.KVEventBatch] = deque(maxlen=capacity)
        self._last_seq = 0
        self._appended = asyncio.Condition()

    async def follow(self, engine: Engine) -> None:
        """Move the engine's events into the log, one batch per engine hand-over."""
        while True:
            events = await engine.next_kv_events()
            self._last_seq += 1
            batch = kvindex_pb2.KVEventBatch(
                node_id=self._node_id,
                model=self._model,
                seq=self._last_seq,
                events=[event_to_proto(event) for event in events],
            )
            async with self._appended:
                self._batches.append(batch)
                self._appended.notify_all()

    async def batches_after(self, seq: int) -> AsyncIterator[kvindex_pb2.KVEventBatch]:
        """Every batch numbered above seq, then each new one as it comes."""
        while True:
            async with self._appended:
                await self._appended.wait_for(lambda after=seq: self._last_seq > after)
                if self._batches and self._batches[0].seq > seq + 1:
                    log.warning("kv event log overran a slow kvindex; %d batches lost",
                                self._batches[0].seq - seq - 1)
                pending = [batch for batch in self._batches if batch.seq > seq]
            for batch in pending:
                seq = batch.seq
                yield batch


async def publish_to_kvindex(log_: KvEventLog, kvindexes: ServiceDirectory) -> None:
    """Stream the log to a kvindex replica, reconnecting (and moving on to another) after errors."""
    seq = 0
    while True:
        addresses = kvindexes.addresses()
        if not addresses:
            await kvindexes.wait_any(timeout_s=3600)
            continue
        for address in addresses:
            stub = kvindex_pb2_grpc.KVIndexStub(kvindexes.channel(address))
            sent = seq

            async def batches(after: int) -> AsyncIterator[kvindex_pb2.KVEventBatch]:
                nonlocal sent
                async for batch in log_.batches_after(after):
                    sent = batch.seq
                    yield batch

            log.info("publishing kv events to kvindex %s from seq %d", address, seq)
            try:
                await stub.Publish(batches(seq))
            except grpc.aio.AioRpcError as exc:
                log.warning("kv event stream to %s broke: %s", address, exc.code().name)
            seq = sent
        await asyncio.sleep(_RETRY_S)
