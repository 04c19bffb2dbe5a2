"""vLLM's KV events from its ZMQ publisher, in sequence order, with lost batches replayed.

vLLM publishes one msgpack batch per engine step as [topic, 8-byte big-endian sequence number,
payload] on a PUB socket, sequence numbers contiguous from 0, and keeps the last batches for replay
on a ROUTER socket: a request [b"", start seq] is answered with every kept batch from there, then
an end marker (sequence -1). A PUB socket drops what a slow or late subscriber misses; the gap
shows in the sequence numbers, and the missing batches are fetched from the replay socket.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from services.common.timeouts import within

log = logging.getLogger(__name__)

_END_SEQ = -1
_REPLAY_TIMEOUT_S = 5.0


class KvEventSubscriber:
    """Subscribes to one vLLM engine's KV events."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str = "kv") -> None:
        import msgspec
        import zmq
        import zmq.asyncio
        from vllm.distributed.kv_events import KVEventBatch

        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.connect(endpoint)
        self._socket.setsockopt(zmq.SUBSCRIBE, self._topic)
        #: Batches lost for good (not replayable): the caller's view was cleared instead.
        self.num_lost_batches = 0

    async def batches(self) -> AsyncIterator[list[KVEvent]]:
        """Each batch's events in Baton's shapes (hashes still vLLM's), in sequence order. Batches
        that were lost and cannot be replayed come as one [AllBlocksCleared()]: whatever was
        learned before them cannot be trusted."""
        expected = 0
        try:
            while True:
                _, seq_bytes, payload = await self._socket.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq < expected:
                    continue  # already had it from a replay
                if seq > expected:
                    replayed = await self._replay(expected, seq)
                    if replayed is None:
                        log.warning("vLLM KV events: batches %d..%d lost, not replayable; clearing", expected, seq - 1)
                        self.num_lost_batches += seq - expected
                        yield [AllBlocksCleared()]
                    else:
                        for missed in replayed:
                            yield self._decode(missed)
                expected = seq + 1
                yield self._decode(payload)
        finally:
            self._socket.close(linger=0)
            self._context.term()

    async def _replay(self, start: int, stop: int) -> list[bytes] | None:
        """The payloads of batches start..stop-1 from vLLM's replay buffer; None if it lacks any."""
        if self._replay_endpoint is None:
            return None
        import zmq

        socket = self._context.socket(zmq.DEALER)
        socket.connect(self._replay_endpoint)
        payloads: dict[int, bytes] = {}
        try:
            await socket.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await within(socket.recv_multipart(), _REPLAY_TIMEOUT_S)
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == _END_SEQ:
                    break
                if start <= seq < stop:
                    payloads[seq] = frames[-1]
        except TimeoutError:
            return None
        finally:
            socket.close(linger=0)
        if sorted(payloads) != list(range(start, stop)):
            return None
        return [payloads[seq] for seq in range(start, stop)]

    def _decode(self, payload: bytes) -> list[KVEvent]:
        return [baton_event(event) for event in self._decoder.decode(payload).events]


def _root_salt(event: Any) -> str:
    """The cache_salt vLLM mixed into a chain's first block: among that block's extra keys (LoRA name,
    multimodal pairs, cache salt, prompt-embedding digests) the string one; Baton uses neither LoRA nor
    multimodal inputs."""
    extra_keys = getattr(event, "extra_keys", None)
    if event.parent_block_hash is not None or not extra_keys or not extra_keys[0]:
        return ""
    return next((key for key in extra_keys[0] if isinstance(key, str)), "")


def baton_event(event: Any) -> KVEvent:
    """vLLM's msgspec KV event as Baton's (same shapes; hashes still vLLM's)."""
    from vllm.distributed.kv_events import AllBlocksCleared as VllmCleared
    from vllm.distributed.kv_events import BlockStored as VllmStored

    if isinstance(event, VllmStored):
        return BlockStored(tuple(event.block_hashes), event.parent_block_hash, tuple(event.token_ids),
                           event.block_size, root_salt=_root_salt(event))
    if isinstance(event, VllmCleared):
        return AllBlocksCleared()
    return BlockRemoved(tuple(event.block_hashes))
