"""vLLM's own ZMQ KV event publisher (no engine needed) read by the vllm engine's subscriber."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.common.kv_events import AllBlocksCleared, BlockStored
from services.node_agent.engines.vllm.kv_subscriber import KvEventSubscriber

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def endpoints(tmp_path: Path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-events-replay"


@pytest.fixture
def publisher(endpoints: tuple[str, str]) -> Iterator[Any]:
    from vllm.distributed.kv_events import ZmqEventPublisher

    publisher = ZmqEventPublisher(0, endpoint=endpoints[0], replay_endpoint=endpoints[1], topic="kv")
    yield publisher
    publisher.shutdown()


def publish_block(publisher: Any, number: int) -> None:
    """One batch storing vLLM block `number`, chained to block number - 1."""
    from vllm.distributed.kv_events import BlockStored as VllmBlockStored
    from vllm.distributed.kv_events import KVEventBatch

    stored = VllmBlockStored(block_hashes=[number], parent_block_hash=number - 1 if number > 1 else None,
                             token_ids=list(range(32)), block_size=32, lora_id=None, medium="GPU", lora_name=None)
    publisher.publish(KVEventBatch(ts=time.time(), events=[stored]))


async def next_within(queue: asyncio.Queue[Any], timeout_s: float) -> Any | None:
    try:
        return await asyncio.wait_for(queue.get(), timeout_s)
    except TimeoutError:
        return None


async def collect(batches: AsyncIterator[Any], queue: asyncio.Queue[Any]) -> None:
    async for batch in batches:
        queue.put_nowait(batch)


async def miss_then_receive(publisher: Any, endpoint: str,
                            make_subscriber: Callable[[], KvEventSubscriber]) -> tuple[int, list[Any], Any]:
    """Batches published before the subscriber exists (so it misses them), then one it receives:
    (number missed, everything it yields for them and that one, the subscriber)."""
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context()
    probe = context.socket(zmq.SUB)
    probe.connect(endpoint)
    probe.setsockopt(zmq.SUBSCRIBE, b"kv")
    deadline = time.monotonic() + 20
    number = 0
    try:
        while True:  # once the probe has one, every batch so far was sent before the subscriber existed
            number += 1
            publish_block(publisher, number)
            try:
                await asyncio.wait_for(probe.recv_multipart(), 0.2)
                break
            except TimeoutError:
                assert time.monotonic() < deadline, "nothing published reached the probe"
    finally:
        probe.close(linger=0)
        context.term()
    num_missed = number
    subscriber = make_subscriber()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    collector = asyncio.create_task(collect(subscriber.batches(), queue))
    received: list[Any] = []
    while len(received) <= num_missed:
        # Its SUB socket joins asynchronously: batches go out until they arrive (each a later step).
        batch = await next_within(queue, 0.2)
        if batch is None:
            assert time.monotonic() < deadline, f"the subscriber received {len(received)} batches"
            number += 1
            publish_block(publisher, number)
            continue
        received.append(batch)
        if batch == [AllBlocksCleared()]:
            break
    collector.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await collector
    return num_missed, received, subscriber


async def test_batches_missed_before_subscribing_are_replayed_in_order(publisher: Any,
                                                                       endpoints: tuple[str, str]) -> None:
    num_missed, batches, subscriber = await miss_then_receive(publisher, endpoints[0],
                                                              lambda: KvEventSubscriber(*endpoints))
    assert all(isinstance(batch[0], BlockStored) for batch in batches)
    assert [batch[0].block_hashes for batch in batches] == [(n,) for n in range(1, num_missed + 2)]
    assert subscriber.num_lost_batches == 0


async def test_without_replay_a_gap_clears_what_was_learned(publisher: Any, endpoints: tuple[str, str]) -> None:
    num_missed, batches, subscriber = await miss_then_receive(
        publisher, endpoints[0], lambda: KvEventSubscriber(endpoints[0], replay_endpoint=None))
    assert batches == [[AllBlocksCleared()]]
    assert subscriber.num_lost_batches >= num_missed
