"""KVIndex gRPC service: protobuf <-> the pure index."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

import grpc

from baton.v1 import kvindex_pb2, kvindex_pb2_grpc, node_agent_pb2, node_agent_pb2_grpc
from services.common import etcd_keys
from services.common.directory import ChannelPool
from services.common.errors import BatonError, InvalidArgument, Unavailable, abort, shown
from services.common.etcd_records import address_of
from services.common.etcd_session import Membership, PrefixView
from services.common.kv_event_proto import event_from_proto
from services.common.server import ServingNames, serve_once
from services.common.telemetry import Telemetry
from services.kvindex.config import KVIndexConfig
from services.kvindex.index import KVIndex

log = logging.getLogger(__name__)

# The most block hashes one batch of KV events may hold: an engine's batch is a few steps' blocks. 1,000,000 in one
# batch held the kvindex 1.8 s and grew it by 385 MB, and two such let its own etcd lease lapse (helper-181). A node
# refused one opens its stream again and catches up from a snapshot.
MAX_BATCH_BLOCKS = 1 << 16


def _num_hashes(event: kvindex_pb2.KVEvent) -> int:
    kind = event.WhichOneof("event")
    return len(getattr(event, kind).block_hashes) if kind in ("stored", "removed") else 0


class KVIndexService(kvindex_pb2_grpc.KVIndexServicer):
    service_names = ("baton.v1.KVIndex",)

    def __init__(self, config: KVIndexConfig, telemetry: Telemetry) -> None:
        self._config = config
        # baton.v1.KVIndex serves once this replica is registered in etcd and has caught up on the nodes listed
        # there (helper-175, helper-177); "" says the process is up.
        self.health = ServingNames(not_serving=self.service_names)
        self._index = KVIndex()
        # Per node: the last batch folded into the index.
        self._last_seq: dict[str, int] = {}
        self._node_addresses: dict[str, str] = {}
        # Nodes whose registration ended, and those back since, waiting for a re-sync.
        self._departed: set[str] = set()
        self._rejoined: asyncio.Queue[str] = asyncio.Queue()
        # Set once every node registered when this replica started has been caught up from its snapshot (or failed
        # to be): before, its answers lack those nodes' blocks.
        self.caught_up = asyncio.Event()
        self._member = Membership(config.etcd, config.lease_ttl_s, config.etcd_credentials())
        self._nodes = PrefixView(self._member.client, etcd_keys.NODES, self._on_nodes_changed)
        self._node_channels = ChannelPool(telemetry)
        self._events = telemetry.meter.create_counter(
            "baton.kvindex.events", description="KV events folded into the index, by node")
        self._snapshots = telemetry.meter.create_counter(
            "baton.kvindex.snapshots", description="re-syncs of a node's blocks from its KV snapshot")

    def register(self, server: grpc.aio.Server) -> None:
        kvindex_pb2_grpc.add_KVIndexServicer_to_server(self, server)

    def background(self) -> Sequence[Coroutine[Any, Any, None]]:
        config = self._config
        return [
            *self._member.hold_service("kvindex", config.instance_id, config.address),
            serve_once(self.health, self.service_names[0], self._member.registered, self.caught_up),
            self._nodes.run(),
            self._resync_rejoined(),
            self._catch_up_at_start(),
        ]

    async def _catch_up_at_start(self) -> None:
        """Take a snapshot of every registered node at once, rather than as each node's event stream reconnects (a
        node's channel may be in reconnect backoff for a second): until then QueryOverlap refuses, so the scheduler
        asks another replica. A replica restarted beside a live one answered "nothing cached" for a second and
        conversations of 6,000 cached tokens moved to another node (helper-129)."""
        await self._nodes.synced.wait()
        pending = sorted(set(self._node_addresses) - set(self._last_seq))
        results = await asyncio.gather(*(self._catch_up(node_id) for node_id in pending), return_exceptions=True)
        for node_id, result in zip(pending, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("could not catch up on node %s at start: %s; its event stream will", node_id, result)
        self.caught_up.set()

    def _on_nodes_changed(self, items: dict[str, bytes]) -> None:
        addresses = {}
        for key, value in items.items():
            try:
                addresses[key.removeprefix(etcd_keys.NODES)] = address_of(value)
            except ValueError as exc:
                log.warning("malformed node registration at %s: %s", key, exc)
        live = set(addresses)
        for node_id in live - set(self._node_addresses):
            if node_id in self._departed:
                # Back after its lease ended: its stream may still be open, so nothing else would
                # tell this replica what it holds now.
                self._departed.discard(node_id)
                self._rejoined.put_nowait(node_id)
        self._node_addresses = addresses
        for node_id in set(self._index.nodes()) | set(self._last_seq):
            if node_id not in live:
                log.info("node %s left; dropping its %d blocks", node_id, self._index.num_blocks(node_id))
                self._index.remove_node(node_id)
                self._last_seq.pop(node_id, None)
                self._departed.add(node_id)

    async def _resync_rejoined(self) -> None:
        while True:
            node_id = await self._rejoined.get()
            try:
                await self._catch_up(node_id)
            except BatonError as error:
                log.warning("could not re-sync node %s: %s", node_id, error)

    async def before_stop(self) -> None:
        await self._member.leave()

    async def close(self) -> None:
        await self._node_channels.close()
        await self._member.close()

    async def Publish(
        self, request_iterator: AsyncIterator[kvindex_pb2.KVEventBatch], context: grpc.aio.ServicerContext
    ) -> kvindex_pb2.PublishAck:
        """Fold a node's event stream in; catch up from a snapshot when the stream opens or skips a batch."""
        node_id = ""
        is_synced = False
        async for batch in request_iterator:
            node_id = batch.node_id
            if (blocks := sum(_num_hashes(event) for event in batch.events)) > MAX_BATCH_BLOCKS:
                await abort(context, InvalidArgument(f"events (node {shown(node_id)}, seq {batch.seq})",
                                                     f"{blocks} block hashes", f"more than {MAX_BATCH_BLOCKS} in one "
                                                     "batch; a node that made it catches up from a snapshot"))
            last = self._last_seq.get(node_id)
            if not is_synced or last is None or batch.seq > last + 1:
                try:
                    last = await self._catch_up(node_id)
                except BatonError as error:
                    await abort(context, error)
                is_synced = True
                if batch.seq > last:
                    # It came before the snapshot was asked for, so the snapshot holds it and its seq: a node's
                    # batch never outruns its own snapshot. One that does would have every later real batch dropped
                    # as "already in the snapshot" (seq 2^64 - 1 froze a node's entries, helper-181).
                    await abort(context, InvalidArgument(f"seq (node {shown(node_id)})", batch.seq,
                                                         f"beyond the node's own snapshot (seq {last})"))
            if batch.seq <= last:
                continue  # the snapshot already holds it
            events = [event_from_proto(message) for message in batch.events]
            if None in events:
                # Refused whole, nothing of it applied: the node's next stream catches up from a snapshot.
                await abort(context, InvalidArgument(f"events[{events.index(None)}] (node {shown(node_id)}, "
                                                     f"seq {batch.seq})",
                                                     "no event type", "not one this kvindex knows (stored, removed, "
                                                     "cleared); the batch is refused"))
            for event in events:
                assert event is not None
                self._index.apply(node_id, batch.model, event)
            self._last_seq[node_id] = batch.seq
            self._events.add(len(batch.events), {"node": node_id})
        return kvindex_pb2.PublishAck(last_seq=self._last_seq.get(node_id, 0))

    async def _catch_up(self, node_id: str) -> int:
        """Replace node_id's blocks with a snapshot from the node; the snapshot's seq."""
        address = self._node_addresses.get(node_id)
        if address is None:
            raise Unavailable(f"node {shown(node_id)} is not registered in etcd; cannot take its KV snapshot")
        stub = node_agent_pb2_grpc.NodeAgentStub(self._node_channels.get(address))
        try:
            snapshot = await stub.GetKVSnapshot(node_agent_pb2.GetKVSnapshotRequest(), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"KV snapshot of node {shown(node_id)} failed: {exc.code().name}") from None
        self._index.reset_node(node_id, snapshot.model, list(snapshot.block_hashes))
        self._last_seq[node_id] = snapshot.seq
        self._snapshots.add(1, {"node": node_id})
        log.info("node %s: caught up from a snapshot of %d blocks at seq %d", node_id,
                 len(snapshot.block_hashes), snapshot.seq)
        return snapshot.seq

    async def QueryOverlap(
        self, request: kvindex_pb2.OverlapRequest, context: grpc.aio.ServicerContext
    ) -> kvindex_pb2.OverlapResponse:
        if not self.caught_up.is_set():
            await abort(context, Unavailable(f"kvindex {self._config.instance_id} is still catching up on the nodes' "
                                             "KV blocks; ask another replica"))
        if len(request.block_hashes) > self._config.max_overlap_blocks:
            await abort(context, InvalidArgument("block_hashes", f"{len(request.block_hashes)} hashes",
                                                 f"more than --max-overlap-blocks ({self._config.max_overlap_blocks})"))
        matched = self._index.overlap(request.model, list(request.block_hashes))
        return kvindex_pb2.OverlapResponse(matched_blocks=matched)
