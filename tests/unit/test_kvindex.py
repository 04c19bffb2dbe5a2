"""The KV block index: what each node holds, per model, and the leading depth it matches."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from baton.v1 import kvindex_pb2, kvindex_pb2_grpc, scheduler_pb2
from services.common.block_hash import DEFAULT_BLOCK_SIZE, MAX_OVERLAP_BLOCKS, block_hashes
from services.common.errors import Unavailable
from services.common.kv_event_proto import event_from_proto, event_to_proto
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from services.common.load import Load
from services.common.telemetry import Telemetry
from services.kvindex.config import KVIndexConfig
from services.kvindex.index import KVIndex
from services.kvindex.servicer import MAX_BATCH_BLOCKS, KVIndexService
from services.scheduler.config import SchedulerConfig
from services.scheduler.fleet import NodeSpec
from services.scheduler.servicer import SchedulerService
from tests.unit.leading import fake_leadership
from tests.unit.test_place_during_election import FakeContext, Refused

M = "m"
PROMPT = [10, 11, 12, 13]  # stand-in block hashes for a four-block prompt


def _stored(*hashes: int, parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=(), block_size=16)


def _index(holdings: dict[tuple[str, str], list[int]]) -> KVIndex:
    """An index where (node, model) holds the given block hashes."""
    index = KVIndex()
    for (node, model), hashes in holdings.items():
        index.apply(node, model, _stored(*hashes))
    return index


def test_overlap_is_the_leading_matched_depth_per_node() -> None:
    index = _index({("a", M): [10, 11, 12, 13], ("b", M): [10, 11, 13], ("c", M): [11, 12, 13], ("d", M): [10]})
    assert index.overlap(M, PROMPT) == {"a": 4, "b": 2, "d": 1}


def test_overlap_of_no_blocks_or_unknown_blocks_is_empty() -> None:
    index = _index({("a", M): PROMPT})
    assert index.overlap(M, []) == {}
    assert index.overlap(M, [99, 10]) == {}


def test_models_are_separate_namespaces() -> None:
    index = _index({("a", "m1"): PROMPT, ("b", "m2"): PROMPT[:2]})
    assert index.overlap("m1", PROMPT) == {"a": 4}
    assert index.overlap("m2", PROMPT) == {"b": 2}
    assert index.overlap("m3", PROMPT) == {}


def test_block_removed_shortens_the_match_for_that_node_only() -> None:
    index = _index({("a", M): PROMPT, ("b", M): PROMPT})
    index.apply("a", M, BlockRemoved(block_hashes=(12,)))
    assert index.overlap(M, PROMPT) == {"a": 2, "b": 4}
    index.apply("a", M, BlockRemoved(block_hashes=(10,)))
    assert index.overlap(M, PROMPT) == {"b": 4}


def test_all_blocks_cleared_clears_only_that_model_on_that_node() -> None:
    index = _index({("a", "m1"): PROMPT, ("a", "m2"): PROMPT, ("b", "m1"): PROMPT})
    index.apply("a", "m1", AllBlocksCleared())
    assert index.overlap("m1", PROMPT) == {"b": 4}
    assert index.overlap("m2", PROMPT) == {"a": 4}
    assert index.num_blocks("a") == 4


def test_remove_node_drops_everything_it_held() -> None:
    index = _index({("a", "m1"): PROMPT, ("a", "m2"): PROMPT, ("b", "m1"): PROMPT[:1]})
    index.remove_node("a")
    assert index.overlap("m1", PROMPT) == {"b": 1}
    assert index.overlap("m2", PROMPT) == {}
    assert index.num_blocks("a") == 0
    assert index.nodes() == ["b"]


def test_a_prompt_extending_another_by_whole_blocks_shares_its_leading_hashes() -> None:
    short = list(range(32))
    long = short + list(range(100, 116))
    other = [1] + short[1:]
    assert block_hashes(long)[:2] == block_hashes(short)
    assert len(block_hashes(long)) == 3
    assert len(block_hashes(long + [7] * 15)) == 3  # a trailing partial block has no hash
    assert block_hashes(other)[1] != block_hashes(short)[1]  # chained: the parent changes the key

    index = KVIndex()
    index.apply("a", M, _stored(*block_hashes(short)))
    assert index.overlap(M, block_hashes(long)) == {"a": 2}
    assert index.overlap(M, block_hashes(other)) == {}


@pytest.mark.parametrize(
    "event",
    [
        _stored(2**64 - 1, 5, parent=2**63),
        _stored(1, parent=None),
        BlockStored(block_hashes=(3,), parent_block_hash=0, token_ids=(1, 2, 3), block_size=4),
        BlockRemoved(block_hashes=(2**64 - 1, 0)),
        AllBlocksCleared(),
    ],
)
def test_events_round_trip_through_protobuf(event: KVEvent) -> None:
    message = event_to_proto(event)
    decoded = event_from_proto(type(message).FromString(message.SerializeToString()))
    assert decoded == event


@pytest.mark.timeout(10)
async def test_an_overlap_query_longer_than_max_overlap_blocks_is_refused_naming_its_length() -> None:
    """A million-token prompt's blocks are asked about; 400,000 hashes in one query were taken and walked."""
    service = KVIndexService(KVIndexConfig(), Telemetry("kvindex/test", "none"))
    service.caught_up.set()  # (no etcd here: no node to catch up on)
    service._index.apply("a", M, _stored(*PROMPT))
    try:
        with pytest.raises(Refused) as refused:
            await service.QueryOverlap(kvindex_pb2.OverlapRequest(model=M, block_hashes=[*PROMPT, *range(
                MAX_OVERLAP_BLOCKS - 3)]), FakeContext())  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert (f"block_hashes='{MAX_OVERLAP_BLOCKS + 1} hashes': more than --max-overlap-blocks "
                f"({MAX_OVERLAP_BLOCKS})") in str(refused.value)
        reply = await service.QueryOverlap(kvindex_pb2.OverlapRequest(model=M, block_hashes=[*PROMPT, *range(
            MAX_OVERLAP_BLOCKS - 4)]), FakeContext())  # type: ignore[arg-type]
        assert dict(reply.matched_blocks) == {"a": 4}
    finally:
        await service.close()


@pytest.mark.timeout(10)
async def test_a_replica_answers_only_once_it_has_caught_up_on_every_registered_node(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Restarted beside a live replica, it answered at once from an empty index ("nothing cached") until each node's
    event stream reconnected, and the scheduler, which asks replicas in order, moved conversations off the nodes
    caching them (helper-129). It refuses, so the scheduler asks another, until it has a snapshot of every node
    registered when it started; one whose snapshot fails does not hold it up (its event stream catches up later)."""
    service = KVIndexService(KVIndexConfig(), Telemetry("kvindex/test", "none"))
    snapshots: dict[str, asyncio.Event] = {"a": asyncio.Event(), "b": asyncio.Event()}

    async def catch_up(node_id: str) -> int:
        await snapshots[node_id].wait()
        if node_id == "b":
            raise Unavailable("KV snapshot of node b failed: UNAVAILABLE")
        service._index.apply(node_id, M, _stored(*PROMPT))
        service._last_seq[node_id] = 1
        return 1

    monkeypatch.setattr(service, "_catch_up", catch_up)
    service._node_addresses = {"a": "a:1", "b": "b:1"}
    service._nodes.synced.set()
    starting = asyncio.create_task(service._catch_up_at_start())
    query = kvindex_pb2.OverlapRequest(model=M, block_hashes=list(PROMPT))
    try:
        with pytest.raises(Refused) as refused:
            await service.QueryOverlap(query, FakeContext())  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE and "still catching up" in str(refused.value)
        snapshots["a"].set()
        snapshots["b"].set()
        await asyncio.wait_for(starting, 5)
        reply = await service.QueryOverlap(query, FakeContext())  # type: ignore[arg-type]
        assert dict(reply.matched_blocks) == {"a": 4}
    finally:
        starting.cancel()
        await service.close()


@pytest.mark.timeout(20)
async def test_a_place_of_a_prompt_longer_than_an_overlap_query_holds_still_finds_its_cache(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler asks about the leading --max-overlap-blocks of a longer prompt (a model whose nodes register
    no context may take 2^20 blocks), not all of them, which the kvindex would refuse: no cache match at all."""
    fake_leadership(monkeypatch, lambda: True)
    kvindex = KVIndexService(KVIndexConfig(), Telemetry("kvindex/test", "none"))
    kvindex.caught_up.set()  # (no etcd here: no node to catch up on)
    kvindex._index.apply("n0", M, _stored(*PROMPT))
    server = grpc.aio.server()
    kvindex.register(server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    scheduler = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    scheduler._role.elected.set()
    scheduler._kvindexes.addresses = lambda: [address]  # type: ignore[method-assign]
    scheduler._cluster.set_nodes([NodeSpec(node_id="n0", address="n0:1", gpu="h100", price_per_hour=1.0,
                                           warm_models=frozenset({M}))])
    scheduler._cluster.report_load("n0", Load(kv_blocks_total=1_000_000), time.monotonic())
    num_blocks = MAX_OVERLAP_BLOCKS + 1
    try:
        placement = await scheduler.Place(scheduler_pb2.PlaceRequest(
            request_id="r", model=M, num_prompt_tokens=num_blocks * DEFAULT_BLOCK_SIZE, max_tokens=8,
            block_hashes=[*PROMPT, *range(num_blocks - len(PROMPT))]), FakeContext())  # type: ignore[arg-type]
        assert placement.node_id == "n0" and placement.matched_blocks == len(PROMPT)
    finally:
        await scheduler.close()
        await server.stop(None)
        await kvindex.close()


async def _serve_kvindexes(*servicers: kvindex_pb2_grpc.KVIndexServicer
                           ) -> tuple[list[grpc.aio.Server], list[str]]:
    """A gRPC server for each servicer, started on a free port of 127.0.0.1; the servers and their addresses."""
    servers, addresses = [], []
    for servicer in servicers:
        server = grpc.aio.server()
        kvindex_pb2_grpc.add_KVIndexServicer_to_server(servicer, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    return servers, addresses


def _scheduler_asking(addresses: list[str], config: SchedulerConfig,
                      clock: Callable[[], float] = time.monotonic) -> SchedulerService:
    """A leading scheduler whose kvindex replicas are at addresses, with one warm node, n0, that has reported."""
    scheduler = SchedulerService(config, Telemetry("scheduler/test", "none"), clock=clock)
    scheduler._role.elected.set()
    scheduler._kvindexes.addresses = lambda: list(addresses)  # type: ignore[method-assign]
    scheduler._cluster.set_nodes([NodeSpec(node_id="n0", address="n0:1", gpu="h100", price_per_hour=1.0,
                                           warm_models=frozenset({M}))])
    scheduler._cluster.report_load("n0", Load(kv_blocks_total=1_000_000), clock())
    return scheduler


class _FrozenKVIndex(kvindex_pb2_grpc.KVIndexServicer):
    """A replica that takes every query and answers none (SIGSTOPped, still registered)."""

    def __init__(self) -> None:
        self.asked = 0

    async def QueryOverlap(self, request, context):  # noqa: N802 - the generated servicer's name
        self.asked += 1
        await asyncio.Event().wait()


@pytest.mark.timeout(20)
async def test_a_kvindex_replica_that_failed_is_asked_after_the_others_for_a_while(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A frozen replica first in the order cost every placement the query's whole timeout while it stayed
    registered (helper-129): after it fails once, the next placements ask the other replica first."""
    fake_leadership(monkeypatch, lambda: True)
    frozen, live = _FrozenKVIndex(), KVIndexService(KVIndexConfig(), Telemetry("kvindex/test", "none"))
    live.caught_up.set()  # (no etcd here: no node to catch up on)
    live._index.apply("n0", M, _stored(*PROMPT))
    servers, addresses = await _serve_kvindexes(frozen, live)
    scheduler = _scheduler_asking(addresses, SchedulerConfig())
    try:
        for request_id in ("first", "second", "third"):
            placement = await scheduler.Place(scheduler_pb2.PlaceRequest(
                request_id=request_id, model=M, num_prompt_tokens=len(PROMPT) * DEFAULT_BLOCK_SIZE, max_tokens=8,
                block_hashes=list(PROMPT)), FakeContext())  # type: ignore[arg-type]
            assert placement.matched_blocks == len(PROMPT)  # the live replica's answer
        assert frozen.asked == 1
    finally:
        await scheduler.close()
        for server in servers:
            await server.stop(None)
        await live.close()


class _SlowKVIndex(kvindex_pb2_grpc.KVIndexServicer):
    """A replica that answers every query, later than the scheduler's hedge (a loaded one)."""

    def __init__(self, delay_s: float) -> None:
        self.asked = 0
        self.delay_s = delay_s

    async def QueryOverlap(self, request, context):  # noqa: N802 - the generated servicer's name
        self.asked += 1
        await asyncio.sleep(self.delay_s)  # a slow answer, not a synchronisation
        return kvindex_pb2.OverlapResponse(matched_blocks={"n0": len(request.block_hashes)})


@pytest.mark.timeout(30)
async def test_where_every_kvindex_replica_is_slow_few_placements_ask_a_second_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas that each answer after the hedge's fifth of the timeout: every placement asked both, doubling
    the load on replicas that were slow already (helper-162). Hedges are budgeted as retries: past the budget, the
    first replica asked is waited for, and its answer still places the request with its cache information."""
    fake_leadership(monkeypatch, lambda: True)
    monkeypatch.setattr("services.scheduler.servicer._HEDGE_MIN_PER_S", 0.1)  # 1 hedge in 10 s, beyond a tenth
    slow = [_SlowKVIndex(0.3), _SlowKVIndex(0.3)]
    servers, addresses = await _serve_kvindexes(*slow)
    scheduler = _scheduler_asking(addresses, SchedulerConfig(kvindex_timeout_s=1.0))
    placements = 5  # (more, never Finished, would read as a saturated node and queue)
    try:
        for i in range(placements):
            placement = await scheduler.Place(scheduler_pb2.PlaceRequest(
                request_id=f"r{i}", model=M, num_prompt_tokens=len(PROMPT) * DEFAULT_BLOCK_SIZE, max_tokens=8,
                block_hashes=list(PROMPT)), FakeContext())  # type: ignore[arg-type]
            assert placement.matched_blocks == len(PROMPT)  # a slow answer is still an answer
        asked = sum(s.asked for s in slow)
        # Hedged once, as the budget allows (each had, before); a hedge cancelled before its replica took it (the
        # first answer came) is not asked there.
        assert scheduler._hedges.num_retries(time.monotonic()) == 1 and placements <= asked <= placements + 1, asked
    finally:
        await scheduler.close()
        for server in servers:
            await server.stop(None)


@pytest.mark.timeout(20)
async def test_with_every_kvindex_replica_frozen_placements_go_without_cache_information_and_say_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two frozen replicas, still registered, cost every placement the query's timeout twice, one after the other,
    and its decision showed zeros as if the kvindex had answered them (helper-160). The timeout is the query's, a
    decision says it was made without cache information, and while every replica has failed lately, one is asked
    again once a second: the placements in between do not wait for them."""
    fake_leadership(monkeypatch, lambda: True)
    frozen = [_FrozenKVIndex(), _FrozenKVIndex()]
    servers, addresses = await _serve_kvindexes(*frozen)
    clock = [100.0]
    scheduler = _scheduler_asking(addresses, SchedulerConfig(kvindex_timeout_s=0.1), lambda: clock[0])

    async def place(request_id: str) -> tuple[int, str]:
        """How many queries the frozen replicas took for it, and its decision's fallback."""
        before = sum(f.asked for f in frozen)
        await scheduler.Place(scheduler_pb2.PlaceRequest(
            request_id=request_id, model=M, num_prompt_tokens=len(PROMPT) * DEFAULT_BLOCK_SIZE, max_tokens=8,
            block_hashes=list(PROMPT)), FakeContext())  # type: ignore[arg-type]
        recent = await scheduler.GetRecentDecisions(scheduler_pb2.GetRecentDecisionsRequest(limit=1), FakeContext())
        return sum(f.asked for f in frozen) - before, recent.decisions[0].fallback

    try:
        asked, fallback = await place("first")
        assert asked == 2  # the second asked too once the first had not answered within a fifth of the timeout
        assert "no kvindex answered within 0.1 s (or every one failed lately): placed without cache information" \
            in fallback
        assert (await place("second"))[0] == 1  # every one failed lately: the one that failed first, asked again
        asked, fallback = await place("third")
        assert asked == 0 and "placed without cache information" in fallback  # within the second: none asked
        clock[0] += 1.5
        assert (await place("fourth"))[0] == 1
    finally:
        await scheduler.close()
        for server in servers:
            await server.stop(None)


def _service_with_node_a(monkeypatch: pytest.MonkeyPatch, snapshot_seq: int) -> KVIndexService:
    """A replica whose node a, when asked for a snapshot, holds PROMPT's blocks at snapshot_seq."""
    service = KVIndexService(KVIndexConfig(), Telemetry("kvindex/test", "none"))
    service.caught_up.set()

    async def catch_up(node_id: str) -> int:
        service._index.reset_node(node_id, M, list(PROMPT))
        service._last_seq[node_id] = snapshot_seq
        return snapshot_seq

    monkeypatch.setattr(service, "_catch_up", catch_up)
    return service


async def publish(service: KVIndexService, *batches: kvindex_pb2.KVEventBatch) -> kvindex_pb2.PublishAck:
    async def stream() -> AsyncIterator[kvindex_pb2.KVEventBatch]:
        for batch in batches:
            yield batch

    return await service.Publish(stream(), FakeContext())  # type: ignore[arg-type]


def stored_batch(seq: int, *hashes: int) -> kvindex_pb2.KVEventBatch:
    return kvindex_pb2.KVEventBatch(node_id="a", model=M, seq=seq, events=[event_to_proto(_stored(*hashes))])


@pytest.mark.timeout(10)
async def test_a_batch_beyond_the_nodes_own_snapshot_is_refused_and_the_nodes_real_batches_still_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of seq 2^64 - 1 was taken, and every real batch of that node dropped after it as "already in the
    snapshot": its new prefixes never reached placement (helper-181). No node's batch outruns its own snapshot."""
    service = _service_with_node_a(monkeypatch, snapshot_seq=7)
    try:
        with pytest.raises(Refused) as refused:
            await publish(service, kvindex_pb2.KVEventBatch(node_id="a", model=M, seq=2**64 - 1))
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "seq (node 'a')=18446744073709551615: beyond the node's own snapshot (seq 7)" in str(refused.value)
        ack = await publish(service, kvindex_pb2.KVEventBatch(node_id="a", model=M, seq=7), stored_batch(8, 99))
        assert ack.last_seq == 8
        assert service._index.overlap(M, [99]) == {"a": 1}
    finally:
        await service.close()


@pytest.mark.timeout(10)
async def test_a_batch_of_more_block_hashes_than_an_engine_makes_is_refused_naming_its_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000,000 hashes in one batch held the kvindex 1.8 s and two such let its etcd lease lapse (helper-181)."""
    service = _service_with_node_a(monkeypatch, snapshot_seq=1)
    try:
        with pytest.raises(Refused) as refused:
            await publish(service, kvindex_pb2.KVEventBatch(node_id="a", model=M, seq=1),
                          stored_batch(2, *range(1, MAX_BATCH_BLOCKS + 2)))
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"'{MAX_BATCH_BLOCKS + 1} block hashes': more than {MAX_BATCH_BLOCKS} in one batch" in str(refused.value)
        assert service._index.num_blocks("a") == len(PROMPT)
        ack = await publish(service, kvindex_pb2.KVEventBatch(node_id="a", model=M, seq=1),
                            stored_batch(2, *range(1, MAX_BATCH_BLOCKS + 1)))
        assert ack.last_seq == 2
    finally:
        await service.close()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("unknown", [kvindex_pb2.KVEvent(), kvindex_pb2.KVEvent.FromString(b"\x22\x00")],
                         ids=["no type set", "a type of a newer node"])
async def test_an_event_of_no_known_type_is_refused_naming_it_and_the_nodes_cache_stays_indexed(
        monkeypatch: pytest.MonkeyPatch, unknown: kvindex_pb2.KVEvent) -> None:
    """Taken for "every block cleared", one such event wiped a node's whole cache from the index, and it stayed wiped:
    prompts cached there were computed again elsewhere, and the node's next real batch, of the same seq, was dropped
    as already seen (helper-202)."""
    service = _service_with_node_a(monkeypatch, snapshot_seq=1)
    try:
        batch = kvindex_pb2.KVEventBatch(node_id="a", model=M, seq=2, events=[event_to_proto(_stored(99)), unknown])
        with pytest.raises(Refused) as refused:
            await publish(service, kvindex_pb2.KVEventBatch(node_id="a", model=M, seq=1), batch)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "events[1] (node 'a', seq 2)='no event type': not one this kvindex knows" in str(refused.value)
        assert service._index.overlap(M, list(PROMPT)) == {"a": len(PROMPT)}  # nothing of the batch applied
        ack = await publish(service, kvindex_pb2.KVEventBatch(node_id="a", model=M, seq=1), stored_batch(2, 99))
        assert ack.last_seq == 2 and service._index.overlap(M, [99]) == {"a": 1}
    finally:
        await service.close()
