"""Numbered batches of this node's KV events, streamed to every kvindex replica."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator

import grpc

from baton.v1 import kvindex_pb2, kvindex_pb2_grpc, node_agent_pb2
from services.common.directory import ServiceDirectory, for_each_instance
from services.common.kv_event_proto import event_to_proto
from services.common.repeats import Repeats
from services.node_agent.engines.types import KVEvent
from services.node_agent.model_host import ModelHost

log = logging.getLogger(__name__)

_RETRY_S = 0.5
# How long a Publish stream must last to count as up (its failures' run ends: services/common/repeats.py).
STREAM_UP_S = 5.0


class LogOverrun(Exception):
    """A reader fell further behind than the log keeps; it must start over from a snapshot."""


class KvEventLog:
    """The warm engine's KV events in numbered batches (from 1), kept a while for every publisher."""

    def __init__(self, node_id: str, host: ModelHost, capacity: int = 10_000) -> None:
        self._node_id = node_id
        self._host = host
        self._batches: deque[kvindex_pb2.KVEventBatch] = deque(maxlen=capacity)
        self._last_seq = 0
        self._appended = asyncio.Condition()

    async def follow(self) -> None:
        """Move the engine's events into the log as they come."""
        while True:
            await self._append(*await self._host.next_kv_events())

    async def _append(self, model: str, events: list[KVEvent]) -> None:
        async with self._appended:
            self._last_seq += 1
            self._batches.append(self._batch(self._last_seq, model, events))
            self._appended.notify_all()

    def _batch(self, seq: int, model: str, events: list[KVEvent]) -> kvindex_pb2.KVEventBatch:
        return kvindex_pb2.KVEventBatch(node_id=self._node_id, model=model, seq=seq,
                                        events=[event_to_proto(event) for event in events])

    def snapshot(self) -> node_agent_pb2.KVSnapshot:
        """Every block cached now, and the last batch the snapshot includes.

        It may include events not yet logged too; they come later in batches above seq, and
        replaying them is harmless: each event states where its blocks end up.
        """
        model, block_hashes = self._host.cached_blocks()
        return node_agent_pb2.KVSnapshot(node_id=self._node_id, model=model, seq=self._last_seq,
                                         block_hashes=block_hashes)

    async def stream(self) -> AsyncIterator[kvindex_pb2.KVEventBatch]:
        """A batch with no events carrying the latest seq, then every batch after it as it comes."""
        seq = self._last_seq
        yield self._batch(seq, self._host.warm_model, [])
        while True:
            async with self._appended:
                await self._appended.wait_for(lambda after=seq: self._last_seq > after)
                if self._batches[0].seq > seq + 1:
                    raise LogOverrun(f"needed batch {seq + 1}, the log starts at {self._batches[0].seq}")
                pending = [batch for batch in self._batches if batch.seq > seq]
            for batch in pending:
                seq = batch.seq
                yield batch


async def publish(events: KvEventLog, kvindexes: ServiceDirectory) -> None:
    """Keep one Publish stream open to every registered kvindex replica."""

    async def publish_to(address: str) -> None:
        stub = kvindex_pb2_grpc.KVIndexStub(kvindexes.channel(address))
        failures = Repeats(log)  # (a kvindex away for 15 s was 60 lines of this node's log: helper-175)
        while True:
            if not failures.failing:
                log.info("publishing kv events to kvindex %s", address)
            call = asyncio.ensure_future(stub.Publish(events.stream()))
            try:
                # Up once it has lasted STREAM_UP_S: a kvindex that takes the first batch and then refuses the stream
                # (this node not in its view yet) ends it at once, every retry (helper-177).
                done, _ = await asyncio.wait({call}, timeout=STREAM_UP_S)
                if not done:
                    failures.succeeded("publishing kv events to kvindex %s again", address)
                await call
            except grpc.aio.AioRpcError as exc:
                # Its reason too: at start-up a kvindex may not yet have seen this node's registration in etcd.
                failures.failed("kv event stream to %s broke: %s: %s", address, exc.code().name, exc.details())
            except LogOverrun as exc:
                log.warning("kvindex %s fell behind (%s); it will catch up from a snapshot", address, exc)
            finally:
                call.cancel()
            await asyncio.sleep(_RETRY_S)

    await for_each_instance(kvindexes, publish_to)
