"""KV cache events on the wire: the one converter the node agent (publishing) and the kvindex (indexing) share."""

from __future__ import annotations

from baton.v1 import kvindex_pb2
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


def event_from_proto(message: kvindex_pb2.KVEvent) -> KVEvent | None:
    """The event, or None for one of no type this version knows (none set, or a newer node's): taken for "every block
    cleared", one such event wiped a node's whole cache from the index, for good (helper-202)."""
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
    if kind == "cleared":
        return AllBlocksCleared()
    return None


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
