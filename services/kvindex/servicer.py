"""KVIndex gRPC service: protobuf <-> the pure index."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

import grpc

from baton.v1 import kvindex_pb2, kvindex_pb2_grpc
from services.common import etcd_keys
from services.common.etcd_session import Membership, PrefixView
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from services.kvindex.config import KVIndexConfig
from services.kvindex.index import KVIndex

log = logging.getLogger(__name__)


def event_from_proto(message: kvindex_pb2.KVEvent) -> KVEvent:
    kind = message.WhichOneof("event")
    if kind == "stored":
        stored = message.stored
        return BlockStored(
            block_hashes=tuple(stored.block_hashes),
            parent_block_hash=stored.parent_block_hash if stored.HasField("parent_block_hash") else None,
            token_ids=tuple(stored.token_ids),
            block_size=stored.block_size,
        )
    if kind == "removed":
        return BlockRemoved(block_hashes=tuple(message.removed.block_hashes))
    return AllBlocksCleared()


def event_to_proto(event: KVEvent) -> kvindex_pb2.KVEvent:
    if isinstance(event, BlockStored):
        stored = kvindex_pb2.BlockStored(
            block_hashes=event.block_hashes, token_ids=event.token_ids, block_size=event.block_size
        )
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        return kvindex_pb2.KVEvent(stored=stored)
    if isinstance(event, BlockRemoved):
        return kvindex_pb2.KVEvent(removed=kvindex_pb2.BlockRemoved(block_hashes=event.block_hashes))
    return kvindex_pb2.KVEvent(cleared=kvindex_pb2.AllBlocksCleared())


class KVIndexService(kvindex_pb2_grpc.KVIndexServicer):
    service_names = ("baton.v1.KVIndex",)

    def __init__(self, config: KVIndexConfig) -> None:
        self._config = config
        self._index = KVIndex()
        self._last_seq: dict[str, int] = {}
        self._member = Membership(config.etcd, config.lease_ttl_s)
        self._nodes = PrefixView(self._member.client, etcd_keys.NODES, self._on_nodes_changed)

    def register(self, server: grpc.aio.Server) -> None:
        kvindex_pb2_grpc.add_KVIndexServicer_to_server(self, server)

    def background(self) -> Sequence[Coroutine[Any, Any, None]]:
        config = self._config
        return [*self._member.hold_service("kvindex", config.instance_id, config.listen), self._nodes.run()]

    def _on_nodes_changed(self, items: dict[str, bytes]) -> None:
        live = {key.removeprefix(etcd_keys.NODES) for key in items}
        for node_id in self._index.nodes():
            if node_id not in live:
                log.info("node %s left; dropping its %d blocks", node_id, self._index.num_blocks(node_id))
                self._index.remove_node(node_id)
                self._last_seq.pop(node_id, None)

    async def before_stop(self) -> None:
        await self._member.leave()

    async def close(self) -> None:
        await self._member.close()

    async def Publish(
        self, request_iterator: AsyncIterator[kvindex_pb2.KVEventBatch], context: grpc.aio.ServicerContext
    ) -> kvindex_pb2.PublishAck:
        last_seq = 0
        async for batch in request_iterator:
            if last_seq == 0:
                log.info("kv events from node %s arriving from seq %d", batch.node_id, batch.seq)
            for message in batch.events:
                self._index.apply(batch.node_id, batch.model, event_from_proto(message))
            self._last_seq[batch.node_id] = last_seq = batch.seq
        return kvindex_pb2.PublishAck(last_seq=last_seq)

    async def QueryOverlap(
        self, request: kvindex_pb2.OverlapRequest, context: grpc.aio.ServicerContext
    ) -> kvindex_pb2.OverlapResponse:
        matched = self._index.overlap(request.model, list(request.block_hashes))
        return kvindex_pb2.OverlapResponse(matched_blocks=matched)
