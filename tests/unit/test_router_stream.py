"""The router's Generate as a client sees it, against a fake scheduler and fake nodes on 127.0.0.1:
how tokens are merged for a slow reader, and what a failed move costs and says."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from google.protobuf import json_format
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from baton.protocol import DEFAULT_TENANT, LEADER_KEY, LIVE_IDS_PER_REPORT
from baton.v1 import (
    common_pb2,
    node_agent_pb2,
    node_agent_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.common import etcd_keys
from services.common.directory import LeaderRecord
from services.common.errors import (
    Aborted,
    AlreadyExists,
    BatonError,
    Drained,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StreamHeld,
    Unavailable,
    abort,
)
from services.common.gone_from_listing import GONE_MODEL_MEMORY_S
from services.common.telemetry import Telemetry
from services.router.config import RouterConfig
from services.router.http_api import HttpApi
from services.router.relay import MOVE_WAIT_S, Ending, HeldEndings
from services.router.servicer import RouterService
from services.router.tokenizer import TOKENIZERS
from services.router.validation import InputLimits
from services.scheduler.config import SchedulerConfig
from services.scheduler.placement import LeftOutOfReach
from services.scheduler.validation import check_live_requests
from tests.unit.piece_tokenizer import VOCAB_SIZE, PieceTokenizer, token_ids

pytestmark = pytest.mark.timeout(60)

MODEL = "sim-test"
NODE = "node-a"
Chunk = node_agent_pb2.NodeGenerateChunk
NodeHandler = Callable[[node_agent_pb2.NodeGenerateRequest], AsyncIterator[Chunk]]


class _FakeNode(node_agent_pb2_grpc.NodeAgentServicer):
    def __init__(self, handler: NodeHandler) -> None:
        self.handler = handler

    async def Generate(  # noqa: N802 (the generated servicer's name)
        self, request: node_agent_pb2.NodeGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Chunk]:
        try:
            async for chunk in self.handler(request):
                yield chunk
        except BatonError as error:  # a status of the node's own (with its origin metadata, as a node sends it)
            await abort(context, error)


@dataclass
class _FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Places every first attempt on the one node; a move finds nowhere to go, as with one node."""

    node_address: str = ""
    places: list[scheduler_pb2.PlaceRequest] = field(default_factory=list)
    finished: asyncio.Queue[scheduler_pb2.FinishedRequest] = field(default_factory=asyncio.Queue)
    live_reports: asyncio.Queue[scheduler_pb2.LiveRequests] = field(default_factory=asyncio.Queue)
    # The router under test (its background loops are not started unless a test starts one).
    router: RouterService | None = None
    # How long the leader takes to answer a Finished notice.
    finished_delay_s: float = 0.0
    # Has the router read the node's registration, as from etcd (set by _router).
    read_nodes: Callable[[], None] = lambda: None

    async def Place(  # noqa: N802
        self, request: scheduler_pb2.PlaceRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Placement:
        self.places.append(request)
        if request.retry_cause or NODE in request.exclude_node_ids:
            await abort(context, Unavailable(f"model={request.model!r}: no live node has it warm"))
        return scheduler_pb2.Placement(node_id=NODE, address=self.node_address)

    async def Finished(  # noqa: N802
        self, request: scheduler_pb2.FinishedRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.FinishedAck:
        await asyncio.sleep(self.finished_delay_s)  # the modelled leader's latency, not synchronisation
        self.finished.put_nowait(request)
        return scheduler_pb2.FinishedAck()

    async def ReportLiveRequests(  # noqa: N802
        self, request: scheduler_pb2.LiveRequests, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.LiveRequestsAck:
        self.live_reports.put_nowait(request)
        return scheduler_pb2.LiveRequestsAck(num_held=len(request.request_ids), lease_ms=15_000)


@contextlib.asynccontextmanager
async def _server(add: Callable[[grpc.aio.Server], None],
                  interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> AsyncIterator[str]:
    server = grpc.aio.server(interceptors=interceptors)
    add(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def _router(handler: NodeHandler, scheduler: _FakeScheduler | None = None, telemetry: Telemetry | None = None,
                  tokenizer: str = "byte", vocab_size: int = 257, nodes_read: bool = True,
                  **config: object) -> AsyncIterator[tuple[router_pb2_grpc.RouterStub, _FakeScheduler]]:
    """A router serving on 127.0.0.1 that sees one scheduler leader (scheduler, or a _FakeScheduler) and one
    node (no etcd) serving MODEL with tokenizer; its metrics go to telemetry's meter when given. Unless nodes_read,
    the router has not read the nodes yet: scheduler.read_nodes() has it read them."""
    scheduler = scheduler or _FakeScheduler()
    async with contextlib.AsyncExitStack() as stack:
        node_address = await stack.enter_async_context(
            _server(lambda s: node_agent_pb2_grpc.add_NodeAgentServicer_to_server(_FakeNode(handler), s)))
        scheduler.node_address = node_address
        scheduler_address = await stack.enter_async_context(
            _server(lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, s)))
        service = scheduler.router = RouterService(RouterConfig(etcd="127.0.0.1:1", **config),
                                                   telemetry or Telemetry("router/test", "none"))
        leader = LeaderRecord("/baton/election/scheduler/0", 1, scheduler_address)
        service._leader.leader = lambda: leader  # type: ignore[method-assign]
        service._leader.address = lambda: scheduler_address  # type: ignore[method-assign]
        info = common_pb2.NodeInfo(node_id=NODE, address=node_address, price_per_hour=4.25,
                                   models=[common_pb2.ModelInfo(name=MODEL, max_context_tokens=4096,
                                                                tokenizer=tokenizer, vocab_size=vocab_size,
                                                                is_warm=True)])
        scheduler.read_nodes = lambda: service._on_nodes_changed(
            {etcd_keys.node_key(NODE): json_format.MessageToJson(info).encode()})
        if nodes_read:
            scheduler.read_nodes()
        stack.push_async_callback(service.close)
        # With a telemetry given, the router's server traces its calls as a live one does.
        router_address = await stack.enter_async_context(
            _server(service.register, telemetry.server_interceptors() if telemetry else ()))
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(router_address))
        yield router_pb2_grpc.RouterStub(channel), scheduler


def _counted(reader: InMemoryMetricReader, name: str) -> list[tuple[dict, float]]:
    """The data points of the counter name: (attributes, value) each."""
    metrics = reader.get_metrics_data()
    return [(dict(p.attributes), p.value) for rm in (metrics.resource_metrics if metrics else ())
            for sm in rm.scope_metrics for m in sm.metrics if m.name == name for p in m.data.data_points]


def _started() -> Chunk:
    return Chunk(node_id=NODE, started=node_agent_pb2.StreamStarted(heartbeat_interval_ms=100, expected_step_ms=1))


def _token_stream(num_tokens: int, pace_s: float) -> NodeHandler:
    """A node producing one token every pace_s, as a decoding engine does."""

    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        yield _started()
        for i in range(num_tokens):
            await asyncio.sleep(pace_s)  # the modelled decode step, not synchronisation
            chunk = Chunk(node_id=NODE, index=i, token_ids=[97 + i % 26])
            if i == num_tokens - 1:
                chunk.finish_reason = common_pb2.FINISH_REASON_LENGTH
            yield chunk

    return generate


async def _one_token_then_silent(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
    """A node that sends one token and then nothing (its stall is not detected within a test)."""
    yield _started()
    yield Chunk(node_id=NODE, index=0, token_ids=[97])
    await asyncio.Event().wait()


async def test_a_reader_that_sleeps_per_message_gets_merged_tokens() -> None:
    """Issue 15.6: a reader pausing per message used to get one message per token, long after
    the node had finished; now the tokens come merged, all of them, in order."""
    num_tokens = 400
    async with _router(_token_stream(num_tokens, pace_s=0.002)) as (router, _):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=num_tokens))
        messages = []
        async for message in call:
            messages.append(message)
            await asyncio.sleep(0.02)  # a slow reader: what this test is about
    tokens = [t for m in messages for t in m.token_ids]
    assert tokens == [97 + i % 26 for i in range(num_tokens)]
    assert "".join(m.text for m in messages) == "".join(chr(t) for t in tokens)
    assert [m.index for m in messages] == [sum(len(m.token_ids) for m in messages[:i]) for i in range(len(messages))]
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(messages) < num_tokens / 4


async def test_a_move_with_nowhere_to_go_asks_once_for_each_set_of_nodes_and_says_what_happened() -> None:
    """Issue 15.5: a stalled stream on a one-node cluster was placed twice for the same nodes (each a charge on the
    retry budget); now once without the node that stalled it, once with it (its stall may have been a pause), and
    the status names the failure and why it could not move."""
    never = asyncio.Event()

    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        yield _started()
        yield Chunk(node_id=NODE, index=0, token_ids=[97])
        await never.wait()  # then nothing, on every stream: a stopped node
        yield Chunk(node_id=NODE, index=1, token_ids=[98])

    reader = InMemoryMetricReader()
    telemetry = Telemetry("router/test", "none")
    telemetry.meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    async with _router(generate, stall_floor_s=0.2, telemetry=telemetry) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=8))
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in call:
                pass
    assert [(p.retry_cause, list(p.exclude_node_ids)) for p in scheduler.places] == [
        ("", []), ("stalled", [NODE]), ("stalled", [])]
    # Each move says which of its context's tokens it generated already: the leader judges what it has yet to generate
    # from them.
    first, *moves = scheduler.places
    assert first.num_generated_tokens == 0
    assert [(m.num_generated_tokens, m.num_prompt_tokens) for m in moves] == [(1, first.num_prompt_tokens + 1)] * 2
    assert _counted(reader, "baton.router.migrations") == []  # it moved nowhere (counted one: helper-116)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    details = raised.value.details() or ""
    assert f"node {NODE}: stalled" in details and "nor on any other from the node" in details
    assert "could not move it" in details and "no live node has it warm" in details


async def test_a_move_that_finds_the_model_on_no_registered_node_is_unavailable_naming_the_failure() -> None:
    """Every node that had the model died: the leader answers the move NOT_FOUND (no registered node has it), which
    reached the client as is, over HTTP a 404 the openai client does not retry, as if the model did not exist
    (helper-109, a node killed mid-stream with the leader frozen). A move that cannot happen is UNAVAILABLE, naming
    the failure and why."""

    class Gone(_FakeScheduler):
        async def Place(self, request, context):  # noqa: N802
            if request.retry_cause:
                self.places.append(request)
                await abort(context, NotFound(f"model={request.model!r}: no registered node has it"))
            return await super().Place(request, context)

    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        yield _started()
        yield Chunk(node_id=NODE, index=0, token_ids=[97])
        raise RuntimeError("the node died")

    async with _router(generate, Gone()) as (router, scheduler):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=8)):
                pass
    assert [p.retry_cause for p in scheduler.places] == ["", "stream_broken"]
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    details = raised.value.details() or ""
    assert f"node {NODE}:" in details and "could not move it" in details and "no registered node has it" in details


@pytest.mark.parametrize("stream_interval_s", [0.0, 30.0])
async def test_a_stream_that_passes_its_deadline_ends_with_deadline_exceeded_keeping_its_tokens(
        stream_interval_s: float) -> None:
    """Issue 11: deadline_ms was never checked; a stream now ends when it passes it, the tokens sent stay.
    The node sends a token, then four more once the client has it, and then nothing (its stall is not detected
    within the test), so what the client holds does not depend on how fast this machine runs. With a long stream
    interval the four wait to go out merged when the deadline passes: they were dropped, and the client had fewer
    tokens than the error named (57 of 64, helper-125); they go out, then the error."""
    never, more = asyncio.Event(), asyncio.Event()

    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        yield _started()
        yield Chunk(node_id=NODE, index=0, token_ids=[97])
        await more.wait()
        for i in range(1, 5):
            yield Chunk(node_id=NODE, index=i, token_ids=[97 + i])
        await never.wait()
        yield Chunk(node_id=NODE, index=5, token_ids=[102])

    async with _router(generate, stall_floor_s=60.0, stream_interval_s=stream_interval_s) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2000,
                                                          deadline_ms=1000))
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for message in call:
                received.extend(message.token_ids)
                more.set()
        # The leader hears it failed, not that its client went away.
        notice = await asyncio.wait_for(scheduler.finished.get(), 10)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (raised.value.details() or "").startswith("deadline_ms=1000: passed after 5 generated tokens")
    assert received == [97, 98, 99, 100, 101]
    assert notice.outcome == scheduler_pb2.REQUEST_OUTCOME_FAILED


class _DecidingScheduler(_FakeScheduler):
    """A leader that has yet to answer any Place (its own floor would refuse a deadline of 1 ms, once it answered)."""

    async def Place(  # noqa: N802
        self, request: scheduler_pb2.PlaceRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Placement:
        self.places.append(request)
        await asyncio.Event().wait()
        raise AssertionError("unreachable: the wait never ends")


async def _collect(call: grpc.aio.UnaryStreamCall) -> list[router_pb2.GenerateChunk]:
    return [message async for message in call]


@pytest.mark.timeout(30)
async def test_a_request_to_a_router_that_has_not_read_the_nodes_yet_waits_for_them_not_refused_as_unknown() -> None:
    """A router just started answered NOT_FOUND, "not served by this cluster (served: none)", until its first listing
    of the nodes came from etcd (a CI run under load): a code the client does not retry, for a model that is served.
    The request waits for the listing; so does a ListModels."""
    async with _router(_token_stream(3, pace_s=0.001), nodes_read=False) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3))
        reading = asyncio.ensure_future(_collect(call))
        listed = asyncio.ensure_future(router.ListModels(router_pb2.ListModelsRequest()))
        done, _ = await asyncio.wait([reading, listed], timeout=0.3)  # both wait while the nodes are unread
        assert not done
        assert scheduler.router is not None and not scheduler.router.health.serving("baton.v1.Router")
        scheduler.read_nodes()
        assert scheduler.router.health.serving("baton.v1.Router")  # on gRPC health too, once they are read
        messages = await reading
        models = await listed
    assert [t for m in messages for t in m.token_ids] == [97, 98, 99]
    assert [m.name for m in models.models] == [MODEL]


@pytest.mark.timeout(30)
async def test_a_model_whose_nodes_have_all_gone_is_unavailable_to_retry_not_unknown() -> None:
    """When the last node serving a model left etcd (its host died, or it restarts) while other nodes served other
    models, a request for it was NOT_FOUND, "not served by this cluster": a code no client retries."""
    now = [0.0]
    async with _router(_token_stream(3, pace_s=0.001)) as (router, scheduler):
        assert scheduler.router is not None
        scheduler.router._clock = lambda: now[0]
        other = common_pb2.NodeInfo(node_id="other", address="127.0.0.1:1", models=[common_pb2.ModelInfo(
            name="other-model", max_context_tokens=4096, tokenizer="byte", vocab_size=257, is_warm=True)])
        scheduler.router._on_nodes_changed({etcd_keys.node_key("other"): json_format.MessageToJson(other).encode()})
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await _collect(router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3)))
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"model={MODEL!r}: served by this cluster lately, by no node now" in (failed.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as failed:  # one it never served is still unknown
            await _collect(router.Generate(router_pb2.GenerateRequest(model="typo", prompt="hi", max_tokens=3)))
        assert failed.value.code() == grpc.StatusCode.NOT_FOUND
        now[0] = GONE_MODEL_MEMORY_S + 1  # gone for longer: taken out of service, not an outage
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await _collect(router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3)))
        assert failed.value.code() == grpc.StatusCode.NOT_FOUND
        assert not scheduler.places
        scheduler.read_nodes()  # back: served again
        messages = await _collect(router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3)))
    assert [t for m in messages for t in m.token_ids] == [97, 98, 99]


@pytest.mark.timeout(30)
async def test_a_router_that_cannot_read_the_nodes_is_unavailable_saying_so_within_the_call() -> None:
    async with _router(_token_stream(3, pace_s=0.001), nodes_read=False) as (router, scheduler):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3),
                                           timeout=0.5):
                pass
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "has not read the cluster's nodes from etcd" in (failed.value.details() or "")
    assert not scheduler.places


@pytest.mark.timeout(30)
async def test_a_router_that_has_not_read_the_nodes_refuses_bad_fields_at_once() -> None:
    """A request with bad fields waited for the nodes' listing with the rest, up to --leader-wait-s, and got the
    UNAVAILABLE that says to retry it."""
    async with _router(_token_stream(3, pace_s=0.001), nodes_read=False) as (router, scheduler):
        for request, field in ((router_pb2.GenerateRequest(model=MODEL, prompt="hi", temperature=-1), "temperature"),
                               (router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=0), "max_tokens"),
                               (router_pb2.GenerateRequest(model=MODEL, prompt=""), "prompt"),
                               (router_pb2.GenerateRequest(model=MODEL, prompt="hi", request_id="a\x1b"),
                                "request_id")):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await _collect(router.Generate(request, timeout=2))
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failed.value.details()
            assert (failed.value.details() or "").startswith(field)
    assert not scheduler.places


@pytest.mark.timeout(30)
async def test_a_router_that_has_not_read_the_tenant_keys_says_so_within_the_call() -> None:
    """With --auth, the wait for the tenant keys took --leader-wait-s (30 s) whatever the call's deadline: the
    client saw only that its deadline passed."""
    async with _router(_token_stream(3, pace_s=0.001), auth=True) as (router, scheduler):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3),
                                           metadata=(("authorization", "Bearer k"),), timeout=0.5):
                pass
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "tenant keys not read from etcd" in (failed.value.details() or "") and not scheduler.places


async def test_each_router_publishes_its_own_health() -> None:
    """Shared by the instances of a class (a class attribute), one service's health was every other's, and a second
    serve() in one process failed its health loop (helper-139)."""
    first, second = (RouterService(RouterConfig(etcd="127.0.0.1:1"), Telemetry("router/test", "none"))
                     for _ in range(2))
    try:
        first._on_nodes_changed({})  # its first listing of the nodes, empty
        assert first.health.serving("baton.v1.Router") and not second.health.serving("baton.v1.Router")
    finally:
        await first.close()
        await second.close()


@pytest.mark.timeout(30)
async def test_a_deadline_that_passes_while_no_scheduler_leader_is_elected_says_so() -> None:
    """It said only that the deadline passed after 0 tokens, as if a node were slow, through a control-plane outage
    (helper-120: every scheduler killed, requests with deadline_ms 8,000)."""
    async with _router(lambda request: _never(), leader_wait_s=30.0) as (router, scheduler):
        assert scheduler.router is not None
        scheduler.router._leader.leader = lambda: None  # type: ignore[method-assign]  # etcd shows none
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=4,
                                                                      request_id="r", deadline_ms=400)):
                pass
        for notice in scheduler.router._relay._notices:  # it waits for a leader too: the close would wait 5 s for it
            notice.cancel()
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    details = failed.value.details() or ""
    assert details.startswith("deadline_ms=400: passed after 0 generated tokens of request r, its placement waiting")
    assert details.endswith("s for a scheduler leader that answers") and not scheduler.places


@pytest.mark.timeout(30)
async def test_a_deadline_that_passes_while_a_leader_holds_the_placement_does_not_blame_a_leader_wait() -> None:
    """The leader refused once (not yet in office), then took the placement and held it (admission queueing): the
    deadline said the placement was waiting for a leader that answers, from the first refusal (helper-121)."""

    class TakingOffice(_FakeScheduler):
        async def Place(self, request, context):  # noqa: N802
            self.places.append(request)
            if len(self.places) == 1:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not in office yet")
            await asyncio.Event().wait()  # held: queued for admission past the deadline

    async with _router(lambda request: _never(), TakingOffice(), leader_wait_s=30.0) as (router, scheduler):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=4,
                                                                      request_id="r", deadline_ms=1500)):
                pass
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert failed.value.details() == "deadline_ms=1500: passed after 0 generated tokens of request r"
    assert len(scheduler.places) == 2


async def test_a_deadline_below_the_floor_is_refused_naming_it_before_its_timer_or_the_leader_can_answer() -> None:
    # Before, deadline_ms=1 got DEADLINE_EXCEEDED when the router's timer fired first (here: the leader is slow) and
    # INVALID_ARGUMENT when the leader's floor answered first. A resent request's remainder is still timed.
    async with _router(_token_stream(2, 0.0), _DecidingScheduler()) as (router, scheduler):
        with pytest.raises(grpc.aio.AioRpcError) as fresh:
            await router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2,
                                                             deadline_ms=1)).read()
        assert fresh.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (fresh.value.details() or "").startswith("deadline_ms=1: below the floor of 10 ms")
        assert scheduler.places == []
        with pytest.raises(grpc.aio.AioRpcError) as resent:
            await router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2, deadline_ms=1,
                                                             resume=router_pb2.Resume(elapsed_ms=900))).read()
        assert resent.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert (resent.value.details() or "").startswith("deadline_ms=1: passed after 0 generated tokens")


async def test_a_finished_answer_taken_after_its_deadline_ends_without_an_error() -> None:
    # The answer was finished within its deadline; its front end (a slow client's write) asked for the stream's end
    # after the deadline had passed. Before, the client got DEADLINE_EXCEEDED after its finish chunk.
    async with _router(_token_stream(2, 0.0)) as (_, scheduler):
        assert scheduler.router is not None
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        stream = scheduler.router.generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2,
                                                                      deadline_ms=2000), lambda: None)
        while not (await anext(stream)).finish_reason:
            pass
        await asyncio.sleep(sent_at + 2.5 - loop.time())  # a slow client: the deadline passes before it asks again
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        notice = await asyncio.wait_for(scheduler.finished.get(), 10)
    assert notice.outcome == scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED


async def test_a_router_that_stops_sends_the_finished_notices_under_way_before_its_channels_close() -> None:
    # Its last stream has ended for its client, and the leader is slow to take the notice: before, the router closed
    # its channel to the leader at once, the notice was cancelled, and the leader never counted that task.
    scheduler = _FakeScheduler(finished_delay_s=0.3)
    async with _router(_token_stream(2, 0.0), scheduler) as (router, _):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2))
        assert sum(len(m.token_ids) for m in [m async for m in call]) == 2
    # The router has closed (with the context), the leader still serving.
    assert scheduler.finished.get_nowait().outcome == scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED


async def _reading_its_first_reply(service: RouterService, request_id: str) -> asyncio.Task[None]:
    """A front end's task streaming request_id through service.generate, returned once it has the first reply; it
    then waits (as for a slow client) until cancelled."""
    got_first = asyncio.Event()

    async def front_end() -> None:
        request = router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=8, request_id=request_id)
        async with contextlib.aclosing(service.generate(request, lambda: None)) as stream:
            async for _ in stream:
                got_first.set()
                await asyncio.Event().wait()

    task = asyncio.create_task(front_end())
    await asyncio.wait_for(got_first.wait(), 10)
    return task


async def test_a_stream_cut_when_its_router_stops_is_still_told_to_the_leader() -> None:
    # The router stops: its server cancels the streams still open, and the router closes at once. Those streams end
    # over the next turns of the loop; their notices must go out before its channel to the leader closes (before,
    # close found no notice under way, and the one that came next was lost).
    async with _router(_one_token_then_silent, stall_floor_s=60.0) as (_, scheduler):
        service = scheduler.router
        assert service is not None
        open_stream = await _reading_its_first_reply(service, "cut")
        open_stream.cancel()  # as the server's stop cancels its handlers
        await service.close()  # at once, as serve() closes the service after its server's stop
        notice = scheduler.finished.get_nowait()
    assert (notice.request_id, notice.outcome) == ("cut", scheduler_pb2.REQUEST_OUTCOME_CANCELLED)


async def test_a_stream_its_client_cancels_is_reported_cancelled() -> None:
    reader = InMemoryMetricReader()
    telemetry = Telemetry("router/test", "none")
    telemetry.meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    async with _router(_one_token_then_silent, telemetry=telemetry, stall_floor_s=60.0) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=8,
                                                          deadline_ms=60_000))
        assert list((await anext(aiter(call))).token_ids) == [97]
        call.cancel()
        notice = await asyncio.wait_for(scheduler.finished.get(), 10)
    assert notice.outcome == scheduler_pb2.REQUEST_OUTCOME_CANCELLED
    # So does the router's own count of requests by status (it said OK for every client that went away).
    assert _counted(reader, "baton.router.requests") == [({"status": "CANCELLED"}, 1)]



async def test_a_stream_cancelled_again_while_its_relay_closes_still_tells_the_leader() -> None:
    # A caller that cancels twice (a handler torn down while its stream closes) stops waiting for the relay to end;
    # the relay's ending, which comes later, must still reach the leader (before, the stream had told what it held
    # by then, nothing, and the leader never heard the request ended: its admission slot and task stayed open).
    async with _router(_token_stream(1, 0.0)) as (_, scheduler):
        service = scheduler.router
        assert service is not None
        closing, release = asyncio.Event(), asyncio.Event()

        async def relay_slow_to_close(generation: object, request: router_pb2.GenerateRequest,
                                      time_remaining: object, deadline_at: object,
                                      held: HeldEndings) -> AsyncIterator[Chunk]:
            try:
                yield Chunk(node_id=NODE, index=0, token_ids=[97])
                await asyncio.Event().wait()
            finally:
                closing.set()
                await release.wait()  # its node call closing
                held.append(Ending(generation, request, 5, scheduler_pb2.REQUEST_OUTCOME_CANCELLED))  # type: ignore

        service._relay.stream = relay_slow_to_close  # type: ignore[method-assign]
        consumer = await _reading_its_first_reply(service, "twice")
        consumer.cancel()
        # Runs after the consumer's next step (the loop runs callbacks in order), which waits for the relay to end.
        asyncio.get_running_loop().call_soon(consumer.cancel)
        with pytest.raises(asyncio.CancelledError):
            await consumer
        assert closing.is_set() and scheduler.finished.empty()
        release.set()
        notice = await asyncio.wait_for(scheduler.finished.get(), 10)
    assert (notice.request_id, notice.outcome) == ("twice", scheduler_pb2.REQUEST_OUTCOME_CANCELLED)


def test_an_ending_held_is_told_once_settled_and_one_after_at_once() -> None:
    told: list[Ending] = []
    held = HeldEndings(told.append)

    def ending(outcome: scheduler_pb2.RequestOutcome.ValueType) -> Ending:
        return Ending(None, router_pb2.GenerateRequest(), 0, outcome)  # type: ignore[arg-type]

    held.append(ending(scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED))
    assert told == []
    held.settle(delivered=False)  # its client went away before the last reply: not a success
    held.append(ending(scheduler_pb2.REQUEST_OUTCOME_LATE))
    assert [e.outcome for e in told] == [scheduler_pb2.REQUEST_OUTCOME_CANCELLED] * 2


async def test_a_client_gone_before_its_last_reply_went_out_is_not_counted_a_success() -> None:
    # The relay ends as soon as the router's stream takes the last chunk from it, before the chunk is written to
    # the client: a client gone by then (a slow one that gave up) did not get its answer.
    async with _router(_token_stream(3, 0.0)) as (_, scheduler):
        assert scheduler.router is not None
        outcomes = []
        for written in (False, True):
            stream = scheduler.router.generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3),
                                               lambda: None)
            while not (await anext(stream)).finish_reason:
                pass
            if written:  # the front end asks for more once the last reply is written
                with pytest.raises(StopAsyncIteration):
                    await anext(stream)
            await stream.aclose()  # the front end closes it unwritten when its client has gone
            outcomes.append((await asyncio.wait_for(scheduler.finished.get(), 10)).outcome)
    assert outcomes == [scheduler_pb2.REQUEST_OUTCOME_CANCELLED, scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED]


async def test_the_finished_notice_carries_the_price_of_each_node_the_request_ran_on() -> None:
    # The leader charges a node's GPU time at its price; one that began after the node left knows it only from here.
    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        yield _started()
        yield Chunk(node_id=NODE, index=0, token_ids=[97], finish_reason=common_pb2.FINISH_REASON_LENGTH,
                    checkpoint=node_agent_pb2.Checkpoint(gpu_ms=12.5))

    async with _router(generate) as (router, scheduler):
        assert len([m async for m in router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi",
                                                                                 max_tokens=1))]) == 1
        notice = await asyncio.wait_for(scheduler.finished.get(), 10)
    assert dict(notice.gpu_ms_by_node) == {NODE: 12.5}
    assert dict(notice.price_per_hour_by_node) == {NODE: 4.25}


@dataclass
class _MovingScheduler(_FakeScheduler):
    """Places each attempt on a node of its own (node-1, node-2, ...), all served by the one fake node."""

    async def Place(  # noqa: N802
        self, request: scheduler_pb2.PlaceRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Placement:
        self.places.append(request)
        return scheduler_pb2.Placement(node_id=f"node-{len(self.places)}", address=self.node_address)


class _NodesScheduler(_FakeScheduler):
    """Live nodes, node-a and node-b unless nodes says others (all served by the one fake node): the first not
    excluded; none left is UNAVAILABLE, as the leader answers."""

    nodes = ("node-a", "node-b")

    async def Place(  # noqa: N802
        self, request: scheduler_pb2.PlaceRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Placement:
        self.places.append(request)
        left = [n for n in self.nodes if n not in request.exclude_node_ids]
        if not left:
            await abort(context, Unavailable(f"model={request.model!r}: no live node has it warm (excluded: "
                                             f"{', '.join(request.exclude_node_ids)})"))
        return scheduler_pb2.Placement(node_id=left[0], address=self.node_address)


async def _stream_failing_first(nodes: tuple[str, ...], failing: int, stalls: bool, max_tokens: int) -> tuple[
        list[router_pb2.GenerateChunk], grpc.aio.AioRpcError | None, list[list[str]],
        list[node_agent_pb2.NodeGenerateRequest]]:
    """A stream on a cluster of nodes (all served by the one fake node) whose first `failing` attempts fail after a
    token each: paused past the stall deadline (stalls) or broken. Its messages, or its error; the nodes each of its
    placements excluded; the requests the node was sent."""
    requests: list[node_agent_pb2.NodeGenerateRequest] = []
    never = asyncio.Event()

    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        requests.append(request)
        yield _started()
        yield Chunk(node_id=NODE, index=0, token_ids=[97 + request.num_resumed_tokens])
        if len(requests) <= failing:
            if not stalls:
                raise RuntimeError("the node died")
            await never.wait()  # paused past the stall deadline
        yield Chunk(node_id=NODE, index=1, token_ids=[98 + request.num_resumed_tokens],
                    finish_reason=common_pb2.FINISH_REASON_LENGTH)

    placer = _NodesScheduler()
    placer.nodes = nodes
    messages: list[router_pb2.GenerateChunk] = []
    failed: grpc.aio.AioRpcError | None = None
    async with _router(generate, placer, stall_floor_s=0.2) as (router, scheduler):
        try:
            messages = await _collect(router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi",
                                                                                max_tokens=max_tokens)))
        except grpc.aio.AioRpcError as error:
            failed = error
    return messages, failed, [list(p.exclude_node_ids) for p in scheduler.places], requests


@pytest.mark.parametrize("stalls", [True, False])
async def test_a_node_that_only_stalled_a_stream_earlier_takes_it_again_when_no_other_is_left(stalls: bool) -> None:
    """A generation avoided every node that had ever failed it: on two nodes, a moment's stall of each ended every
    stream (no live node left, both live, migrations left), where a client gets the tokens so far and an error
    (helper-154). A node that only stalled it before its last failure may take it back, told to take its place
    from a stream it may still hold; one whose stream broke (its process gone, say) and the one that failed it
    last are still avoided."""
    messages, failed, asked, requests = await _stream_failing_first(("node-a", "node-b"), 2, stalls, max_tokens=4)
    if not stalls:
        assert asked == [[], ["node-a"], ["node-a", "node-b"]]
        assert failed is not None and failed.code() == grpc.StatusCode.UNAVAILABLE
        assert "no live node has it warm (excluded: node-a, node-b)" in (failed.details() or "")
        return
    assert failed is None
    assert [t for m in messages for t in m.token_ids] == [97, 98, 99, 100]
    assert messages[-1].usage.num_migrations == 2
    # Every failed node excluded first, then only the last: node-a took it back, in place of its stalled stream.
    assert asked == [[], ["node-a"], ["node-a", "node-b"], ["node-b"]]
    assert [r.resent for r in requests] == [False, False, True]


@pytest.mark.parametrize("stalls", [True, False])
async def test_the_only_node_of_a_model_takes_back_a_stream_it_only_stalled(stalls: bool) -> None:
    """A pause of a second or two of the only node serving a model (or the last one alive) ended every stream on
    it, the node healthy again half a second later: even the loosest ask avoided the node that failed it last
    (helper-167). A stall is no death: that node takes it back, told to take the place of the stream it may still
    hold. One whose stream broke is still avoided."""
    messages, failed, asked, requests = await _stream_failing_first(("node-a",), 1, stalls, max_tokens=3)
    if not stalls:
        assert asked == [[], ["node-a"]]
        assert failed is not None and failed.code() == grpc.StatusCode.UNAVAILABLE
        return
    assert failed is None
    assert [t for m in messages for t in m.token_ids] == [97, 98, 99]
    assert messages[-1].usage.num_migrations == 1
    assert asked == [[], ["node-a"], []]
    assert [r.resent for r in requests] == [False, True]


@pytest.mark.parametrize("dropped_for_unanswered_pings", [True, False])
async def test_a_node_that_dropped_this_router_for_unanswered_pings_is_not_avoided(
        dropped_for_unanswered_pings: bool) -> None:
    """A node drops a caller whose pings go unanswered (a router frozen or cut off): the router, awake again, took
    that for the node's failure, and its placements, this stream's move included, avoided a healthy node (for
    --suspect-s; helper-122). The stream still moves; the node is not avoided."""
    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        yield _started()
        if request.num_resumed_tokens == 0:
            yield Chunk(node_id=NODE, index=0, token_ids=[97])
            if dropped_for_unanswered_pings:
                raise Unavailable("ping timeout")  # what gRPC tells the caller of a node that dropped it so
            raise RuntimeError("the node died")
        yield Chunk(node_id=NODE, index=0, token_ids=[98], finish_reason=common_pb2.FINISH_REASON_LENGTH)

    async with _router(generate, _MovingScheduler()) as (router, scheduler):
        messages = [m async for m in router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi",
                                                                                max_tokens=2))]
    assert [t for m in messages for t in m.token_ids] == [97, 98]
    assert [p.retry_cause for p in scheduler.places] == ["", "stream_broken"]
    assert ("node-1" in scheduler.places[1].exclude_node_ids) is not dropped_for_unanswered_pings


async def test_a_stream_that_moves_twice_reports_what_both_moves_prefilled_again() -> None:
    """recomputed_tokens counted only the last move's prefill: the node that took the first move and then died too had
    prefilled the context again as well, and that was lost from usage and from baton.router.recomputed_tokens."""

    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        resumed, context = request.num_resumed_tokens, len(request.prompt_token_ids)
        cached = {0: 0, 3: 1, 5: 4}[resumed]  # what each attempt's node found cached of the context sent to it
        last = {0: 3, 3: 5, 5: 8}[resumed]  # the first node dies after token 3, the second after token 5
        yield _started()
        for i in range(last - resumed):
            chunk = Chunk(node_id=NODE, index=i, token_ids=[97 + resumed + i],
                          checkpoint=node_agent_pb2.Checkpoint(num_context_tokens=context + i + 1,
                                                               num_completion_tokens=i + 1, num_cached_tokens=cached))
            if last == 8 and i == last - resumed - 1:
                chunk.finish_reason = common_pb2.FINISH_REASON_LENGTH
                chunk.usage.CopyFrom(common_pb2.Usage(prompt_tokens=context, cached_tokens=cached,
                                                      completion_tokens=i + 1))
            yield chunk
        if last < 8:
            raise RuntimeError("the node died")

    reader = InMemoryMetricReader()
    telemetry = Telemetry("router/test", "none")
    telemetry.meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    async with _router(generate, _MovingScheduler(), telemetry=telemetry) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=8))
        messages = [message async for message in call]
        await asyncio.wait_for(scheduler.finished.get(), 10)  # the stream has settled
    assert _counted(reader, "baton.router.requests") == [({"status": "OK"}, 1)]
    assert _counted(reader, "baton.router.recomputed_tokens") == [({"model": MODEL}, 7)]
    assert _counted(reader, "baton.router.migrations") == [({"cause": "stream_broken"}, 2)]
    assert [t for m in messages for t in m.token_ids] == [97 + i for i in range(8)]
    usage = messages[-1].usage
    assert usage.num_migrations == 2
    assert [p.resumed for p in scheduler.places] == [False, True, True]
    prompt = scheduler.places[0].num_prompt_tokens
    assert usage.recomputed_tokens == (prompt + 3 - 1) + (prompt + 5 - 4)


def _traced() -> tuple[Telemetry, InMemorySpanExporter]:
    """A router's telemetry whose finished spans the exporter keeps."""
    spans = InMemorySpanExporter()
    telemetry = Telemetry("router/test", "none")
    telemetry.tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    return telemetry, spans


def _two_tokens(dies_first: bool) -> NodeHandler:
    """Two tokens and a finish; when dies_first, a fresh (not resumed) stream dies after its first token."""

    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        yield _started()
        yield Chunk(node_id=NODE, index=0, token_ids=[97 + request.num_resumed_tokens])
        if dies_first and not request.num_resumed_tokens:
            raise RuntimeError("the node died")
        yield Chunk(node_id=NODE, index=1, token_ids=[98 + request.num_resumed_tokens],
                    finish_reason=common_pb2.FINISH_REASON_LENGTH)

    return generate


@pytest.mark.parametrize("moves", [False, True])
async def test_each_call_to_a_node_ends_its_trace_span_when_the_stream_ends(moves: bool) -> None:
    """The tracing interceptor ends a streaming call's client span only when its response iterator ends: left
    suspended after the finish chunk (or a node failure), the span waited for the garbage collector, and a live
    probe found 5 of 17 never exported, the node's own spans pointing at a parent that was not there."""
    telemetry, spans = _traced()
    generate = _two_tokens(dies_first=moves)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # what the collector would end late (or, at exit, never) must be ended by the router itself
    try:
        scheduler = _MovingScheduler() if moves else _FakeScheduler()
        async with _router(generate, scheduler, telemetry=telemetry) as (router, scheduler):
            call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3 if moves else 2))
            assert [m async for m in call][-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            await asyncio.wait_for(scheduler.finished.get(), 10)  # the stream has settled
            ended = [s.name for s in spans.get_finished_spans() if s.name.endswith("NodeAgent/Generate")]
    finally:
        if gc_was_enabled:
            gc.enable()
    assert ended == ["/baton.v1.NodeAgent/Generate"] * (2 if moves else 1)


async def test_a_requests_span_says_which_node_failed_it_and_how_it_ended() -> None:
    """The span of the router's call to the node it left ends UNSET, as a cancelled call's does: a trace showed a
    moved request as two calls that went well. Its own span names the node that failed it, the cause and the tokens
    it had, and how it ended."""
    telemetry, spans = _traced()
    async with _router(_two_tokens(dies_first=True), _MovingScheduler(), telemetry=telemetry) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3))
        assert [m async for m in call][-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        await asyncio.wait_for(scheduler.finished.get(), 10)  # the stream has settled
    served = [s for s in spans.get_finished_spans() if s.name == "/baton.v1.Router/Generate"]
    assert len(served) == 1
    span = served[0]
    assert span.attributes is not None
    assert (span.attributes["baton.outcome"], span.attributes["baton.migrations"], span.attributes["baton.tokens"]) \
        == ("succeeded", 1, 3)
    # Found by its id (no span carried one, helper-158), as its calls to the leader and the nodes name it.
    assert span.attributes["baton.request_id"] == scheduler.places[0].request_id != ""
    failures = [e for e in span.events if e.name == "baton.node_failure"]
    assert len(failures) == 1 and failures[0].attributes is not None
    assert (failures[0].attributes["baton.node_id"], failures[0].attributes["baton.cause"],
            failures[0].attributes["baton.tokens"]) == ("node-1", "stream_broken", 1)


async def test_a_stream_a_draining_node_hands_on_moves_as_drained_not_as_a_crash() -> None:
    """A node shutting down ends the streams still running as its grace ends, UNAVAILABLE with DRAINED_KEY: the
    move's cause, told the leader and on the request's span, is "drained". Cut by the server's stop, each was
    counted "stream_broken", as a crash (helper-158)."""
    telemetry, spans = _traced()

    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        yield _started()
        yield Chunk(node_id=NODE, index=0, token_ids=[97 + request.num_resumed_tokens])
        if not request.num_resumed_tokens:
            raise Drained("request r: node node-1 is shutting down", "node-1")
        yield Chunk(node_id=NODE, index=1, token_ids=[98], finish_reason=common_pb2.FINISH_REASON_LENGTH)

    async with _router(generate, _MovingScheduler(), telemetry=telemetry) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2))
        assert [m async for m in call][-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        await asyncio.wait_for(scheduler.finished.get(), 10)  # the stream has settled
    assert [p.retry_cause for p in scheduler.places] == ["", "drained"]
    (served,) = [s for s in spans.get_finished_spans() if s.name == "/baton.v1.Router/Generate"]
    (moved,) = [e for e in served.events if e.name == "baton.node_failure"]
    assert moved.attributes is not None and moved.attributes["baton.cause"] == "drained"


class _QueueingScheduler(_FakeScheduler):
    """A leader that holds every placement in its admission queue until the router gives up on it."""

    def __init__(self) -> None:
        super().__init__()
        self.queued = asyncio.Event()
        self.left_queue = asyncio.Event()

    async def Place(  # noqa: N802
        self, request: scheduler_pb2.PlaceRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Placement:
        self.places.append(request)
        self.queued.set()
        try:
            await asyncio.Event().wait()
        finally:  # the call was cancelled: its place in the queue is given up (as Gate.enter does)
            self.left_queue.set()
        raise AssertionError("unreachable")


async def test_a_client_that_leaves_while_its_request_is_queued_takes_it_out_of_the_leaders_queue() -> None:
    """The router cancels its Place when its client goes away, and the leader's queue loses the request at once.
    Through OpenTelemetry's client interceptor the cancel never reached the call: the request stayed queued, was placed
    for no one, and held its tenant's only slot until the slot's lease ran out, 17 s later (helper-157)."""
    telemetry, spans = _traced()
    scheduler = _QueueingScheduler()
    async with _router(_two_tokens(dies_first=False), scheduler, telemetry=telemetry) as (router, _):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2))
        await asyncio.wait_for(scheduler.queued.wait(), 10)
        call.cancel()
        await asyncio.wait_for(scheduler.left_queue.wait(), 5)
    placing = [s for s in spans.get_finished_spans() if s.name == "/baton.v1.Scheduler/Place"]
    assert len(placing) == 1 and placing[0].attributes is not None
    assert placing[0].attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]


async def test_a_requests_span_says_which_node_refused_to_take_it_over() -> None:
    """A node that runs another stream of the id (a frozen router's, say) refuses the takeover; the request runs
    elsewhere, no move counted, and its span says which node refused and why (it had no test of its own)."""
    telemetry, spans = _traced()

    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        if len(scheduler.places) == 1:
            raise StreamHeld("request_id='r1': node-1 runs it in another stream", "node-1")
        yield _started()
        yield Chunk(node_id=NODE, index=0, token_ids=[97], finish_reason=common_pb2.FINISH_REASON_LENGTH)

    async with _router(generate, _MovingScheduler(), telemetry=telemetry) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=1, request_id="r1"))
        assert [m async for m in call][-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        await asyncio.wait_for(scheduler.finished.get(), 10)  # the stream has settled
    assert len(scheduler.places) == 2
    served = [s for s in spans.get_finished_spans() if s.name == "/baton.v1.Router/Generate"]
    assert len(served) == 1 and served[0].attributes is not None
    assert (served[0].attributes["baton.outcome"], served[0].attributes["baton.migrations"]) == ("succeeded", 0)
    refused = [e for e in served[0].events if e.name == "baton.takeover_refused"]
    assert len(refused) == 1 and refused[0].attributes is not None
    assert refused[0].attributes["baton.node_id"] == "node-1"
    assert not [e for e in served[0].events if e.name == "baton.node_failure"]


@pytest.mark.timeout(30)
async def test_a_requests_span_ends_as_the_leader_is_told_when_its_client_left_before_the_last_reply(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay ends as soon as it reads the finish, before its client takes the last reply; a client gone then
    is a cancelled task, and the span said it had succeeded (helper-153)."""
    telemetry, spans = _traced()
    relay_ended = asyncio.Event()
    append = HeldEndings.append

    def appended(held: HeldEndings, ending: Ending) -> None:
        append(held, ending)
        relay_ended.set()

    monkeypatch.setattr(HeldEndings, "append", appended)
    async with _router(_token_stream(3, pace_s=0.001), telemetry=telemetry) as (router, scheduler):
        assert scheduler.router is not None
        service, first_reply = scheduler.router, asyncio.Event()

        async def front_end() -> None:  # as the HTTP API's: the request's span around the router's stream
            with telemetry.tracer_provider.get_tracer("test").start_as_current_span("POST /v1/completions"):
                request = router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3)
                async with contextlib.aclosing(service.generate(request, lambda: None)) as replies:
                    async for _ in replies:
                        first_reply.set()
                        await asyncio.Event().wait()  # slow to take the rest, then gone

        client = asyncio.ensure_future(front_end())
        await asyncio.wait_for(first_reply.wait(), 10)
        await asyncio.wait_for(relay_ended.wait(), 10)
        client.cancel()
        notice = await asyncio.wait_for(scheduler.finished.get(), 10)
    assert notice.outcome == scheduler_pb2.REQUEST_OUTCOME_CANCELLED
    (span,) = [s for s in spans.get_finished_spans() if s.name == "POST /v1/completions"]
    assert span.attributes is not None and span.attributes["baton.outcome"] == "cancelled"


async def test_a_node_that_fails_after_the_last_token_ends_the_stream_complete_without_a_move() -> None:
    """A node that sent every token max_tokens allows and then died before its finish chunk: the
    generation is complete, so it ends with FINISH_REASON_LENGTH instead of asking the scheduler to
    move a request with nothing left to generate (which the scheduler refuses: max_tokens=0)."""

    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        yield _started()
        for i in range(8):
            yield Chunk(node_id=NODE, index=i, token_ids=[97 + i])
        raise RuntimeError("the node died")

    # No migration is left (max_migrations=0), and none is needed: nothing moves.
    async with _router(generate, max_migrations=0) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=8))
        messages = [message async for message in call]
    assert [t for m in messages for t in m.token_ids] == [97 + i for i in range(8)]
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert messages[-1].usage.num_migrations == 0
    assert [p.retry_cause for p in scheduler.places] == [""]


@pytest.mark.parametrize(("resume", "outcome"), [
    # Resumed here after its router died: its first token came 3 s after it was first sent, past its 1 s budget.
    (router_pb2.Resume(token_ids=[97], elapsed_ms=3500, first_token_ms=3000), scheduler_pb2.REQUEST_OUTCOME_LATE),
    # Without the client's timeline, as an older client sends it: judged from here, on time.
    (router_pb2.Resume(token_ids=[97]), scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED),
])
async def test_a_resumed_stream_is_judged_on_its_clients_timeline(
        resume: router_pb2.Resume, outcome: scheduler_pb2.RequestOutcome.ValueType) -> None:
    async with _router(_token_stream(2, pace_s=0.001)) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3, ttft_budget_ms=1000,
                                                          tpot_budget_ms=60_000, resume=resume))
        assert sum(len(m.token_ids) for m in [m async for m in call]) == 2
        notice = await asyncio.wait_for(scheduler.finished.get(), 10)
    assert notice.outcome == outcome
    # The leader is told it resumes: its first token came before, and its budgets are not refused as impossible.
    assert [p.resumed for p in scheduler.places] == [True]


async def test_a_stream_resumed_through_another_router_reports_what_its_node_prefilled_again() -> None:
    """Its new node prefills the prompt and the tokens the client already has, less what it caches: recomputed as a
    move's node's are (it was counted only after a move)."""

    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        context = len(request.prompt_token_ids)
        yield _started()
        yield Chunk(node_id=NODE, index=0, token_ids=[99], finish_reason=common_pb2.FINISH_REASON_LENGTH,
                    checkpoint=node_agent_pb2.Checkpoint(num_context_tokens=context + 1, num_completion_tokens=1,
                                                         num_cached_tokens=1),
                    usage=common_pb2.Usage(prompt_tokens=context, cached_tokens=1, completion_tokens=1))

    async with _router(generate) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3,
                                                          resume=router_pb2.Resume(token_ids=[97, 98])))
        messages = [m async for m in call]
    prompt = scheduler.places[0].num_prompt_tokens  # the context: the prompt and the two tokens resumed
    assert messages[-1].usage.recomputed_tokens == prompt - 1 and messages[-1].usage.num_migrations == 0


async def test_a_request_sent_again_before_its_first_token_is_told_to_the_leader_as_resumed() -> None:
    """Its router died before the first token: the client SDK sends it again with what is left of its deadline and
    no tokens. That remainder is the SDK's arithmetic: the leader must not refuse it as a budget no node could meet."""
    sent: list[node_agent_pb2.NodeGenerateRequest] = []
    node = _token_stream(2, pace_s=0.001)

    def noting(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        sent.append(request)
        return node(request)

    async with _router(noting) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2, deadline_ms=50,
                                                          resume=router_pb2.Resume(elapsed_ms=900)))
        assert sum(len(m.token_ids) for m in [m async for m in call]) == 2
    assert [p.resumed for p in scheduler.places] == [True]
    # And its node hears it was sent again: one still running it from the first router gives it that stream's place.
    assert [(r.resent, r.num_resumed_tokens) for r in sent] == [(True, 0)]


async def test_a_resumed_streams_first_token_reported_past_its_elapsed_time_counts_as_at_the_resume() -> None:
    # A client's rounding can put first_token_ms past elapsed_ms (up to a second is taken as such): its first token
    # came no later than the resume, so the leader hears a TTFT of elapsed_ms and an on-time request (1500 ms would
    # be past its 1 s budget).
    resume = router_pb2.Resume(token_ids=[97], elapsed_ms=500, first_token_ms=1500)
    async with _router(_token_stream(2, pace_s=0.001)) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3, ttft_budget_ms=1000,
                                                          tpot_budget_ms=60_000, resume=resume))
        assert sum(len(m.token_ids) for m in [m async for m in call]) == 2
        notice = await asyncio.wait_for(scheduler.finished.get(), 10)
    assert notice.ttft_ms == pytest.approx(500, abs=1)  # whole milliseconds of a float difference
    assert notice.outcome == scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED


@pytest.mark.parametrize(("last_token_ms", "outcome"), [
    (None, scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED),  # an older client: its time per token is not judged
    (300, scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED),  # 100 ms a token, within the 150 ms budget
    (500, scheduler_pb2.REQUEST_OUTCOME_LATE),  # 200 ms a token, on the client's timeline
])
async def test_a_resumed_request_that_has_every_token_ends_at_once_and_the_leader_hears_it(
        last_token_ms: int | None, outcome: scheduler_pb2.RequestOutcome.ValueType) -> None:
    # Its router died after the last token, before the finish: the next router ends it without a node, and its
    # task is counted (before, no notice was sent: the leader never heard the request ended), judged on the
    # client's timeline (before last_token_ms, its time per token went unjudged: no token came here).
    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        raise AssertionError("no node is asked")
        yield  # an async generator

    async with _router(generate) as (router, scheduler):
        resume = router_pb2.Resume(token_ids=[97, 98, 99], elapsed_ms=600, first_token_ms=100,
                                   last_token_ms=last_token_ms)
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3, resume=resume,
                                                          tpot_budget_ms=150))
        messages = [m async for m in call]
        notice = await asyncio.wait_for(scheduler.finished.get(), 10)
    assert [(m.index, list(m.token_ids), m.finish_reason) for m in messages] == [
        (3, [], common_pb2.FINISH_REASON_LENGTH)]
    assert notice.outcome == outcome and not scheduler.places


async def _live_reports(scheduler: _FakeScheduler, count: int) -> list[scheduler_pb2.LiveRequests]:
    """The first count live-request reports of scheduler's router, its report loop run until then."""
    assert scheduler.router is not None
    reporting = asyncio.create_task(scheduler.router._report_live())
    try:
        return [await asyncio.wait_for(scheduler.live_reports.get(), 10) for _ in range(count)]
    finally:
        reporting.cancel()


async def test_the_router_reports_the_workflows_of_the_steps_it_serves() -> None:
    # A step can run longer than the leader's task timeout: the leader hears its workflow is alive.
    async with _router(_one_token_then_silent, stall_floor_s=60.0, live_report_interval_s=0.05) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=8, request_id="s2",
                                                          workflow_id="wf-1", step=2, total_steps=3))
        assert list((await anext(aiter(call))).token_ids) == [97]
        report = (await _live_reports(scheduler, 1))[0]
        call.cancel()
    assert list(report.request_ids) == ["s2"] and list(report.workflow_ids) == ["wf-1"]
    # Placed, it is named with its tenant: a leader that holds no slot for it (it took over within a second of its
    # admission) gives it one (helper-134).
    assert list(report.tenants) == [DEFAULT_TENANT]
    # And its prompt: a "resume" of another prompt under its id is refused there as on a slot the leader admitted.
    assert list(report.prompt_digests) == [scheduler.places[0].prompt_digest] and report.prompt_digests[0]


async def test_a_refused_resend_of_another_prompt_does_not_blank_the_running_streams_report() -> None:
    """A resend of a running id with `resume` and another prompt, through the same router, took the id's place in
    the router's reports; refused, it left the running stream reported with no tenant and no prompt for the rest
    of its life, and a successor leader gave it no slot (helper-143)."""

    class RefusingResends(_FakeScheduler):
        async def Place(self, request, context):  # noqa: N802
            if self.places:
                self.places.append(request)
                await abort(context, AlreadyExists("request_id='s2': is already running as another request"))
            return await super().Place(request, context)

    scheduler = RefusingResends()
    async with _router(_one_token_then_silent, scheduler, stall_floor_s=60.0,
                       live_report_interval_s=0.05) as (router, _):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=8, request_id="s2"))
        assert list((await anext(aiter(call))).token_ids) == [97]
        with pytest.raises(grpc.aio.AioRpcError):
            await router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="bye", max_tokens=8,
                                                             request_id="s2",
                                                             resume=router_pb2.Resume(elapsed_ms=10))).read()
        report = (await _live_reports(scheduler, 1))[0]
        call.cancel()
    assert list(report.request_ids) == ["s2"] and list(report.tenants) == [DEFAULT_TENANT]
    assert list(report.prompt_digests) == [scheduler.places[0].prompt_digest]


async def test_the_router_reports_its_live_requests_to_a_new_leader_at_once() -> None:
    # A successor that took over holding no slot for a running request gives it one from the router's report; until
    # then a request of its tenant is let past the tenant's limit (helper-135). The report does not wait its interval.
    async with _router(_one_token_then_silent, live_report_interval_s=3600.0) as (_, scheduler):
        assert scheduler.router is not None
        service = scheduler.router
        service._live.update(["r"])
        shown = asyncio.Event()

        async def wait_for_other(leader: LeaderRecord | None, timeout_s: float) -> LeaderRecord | None:
            await shown.wait()  # etcd shows a new leader (here: the same address, another key)
            shown.clear()
            return service._leader.leader()

        service._leader.wait_for_other = wait_for_other  # type: ignore[method-assign]
        reporting = asyncio.create_task(service._report_live())
        try:
            shown.set()
            report = await asyncio.wait_for(scheduler.live_reports.get(), 10)
        finally:
            reporting.cancel()
    assert list(report.request_ids) == ["r"]
    assert report.router_incarnation == service._relay.incarnation != 0  # which process of the router reports


async def test_a_router_serving_more_requests_than_one_report_holds_splits_its_report() -> None:
    # The leader refuses a report longer than its --max-live-ids: each part the router sends is within its default.
    async with _router(_one_token_then_silent, live_report_interval_s=0.05) as (_, scheduler):
        assert scheduler.router is not None
        num_live = 2 * LIVE_IDS_PER_REPORT + 1
        scheduler.router._live.update(f"r{n}" for n in range(num_live))
        scheduler.router._live_workflows.update((f"r{n}", f"wf{n}") for n in range(num_live))
        reports = await _live_reports(scheduler, 3)
    for report in reports:
        check_live_requests(report, SchedulerConfig().max_live_ids, SchedulerConfig().max_id_len)
    assert [len(r.request_ids) for r in reports] == [LIVE_IDS_PER_REPORT, LIVE_IDS_PER_REPORT, 1]
    assert all(list(r.tenants) == [""] * len(r.request_ids) for r in reports)  # none of them placed yet
    assert all(list(r.prompt_digests) == [0] * len(r.request_ids) for r in reports)
    assert sum(len(r.workflow_ids) for r in reports) == num_live


async def test_a_finished_notice_refused_by_a_standby_goes_to_the_leader_it_names() -> None:
    # The router's view of the leader lags: the replica it tells refuses (its ledger would be overwritten when
    # it takes over) and names the leader, which counts the task.
    leader = _FakeScheduler()

    @dataclass
    class Standby(_FakeScheduler):
        leader_address: str = ""

        async def Finished(  # noqa: N802
            self, request: scheduler_pb2.FinishedRequest, context: grpc.aio.ServicerContext
        ) -> scheduler_pb2.FinishedAck:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a standby",
                                trailing_metadata=((LEADER_KEY, self.leader_address),))
            raise AssertionError("aborted")

    async with _server(lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(leader, s)) as leader_address:
        standby = Standby(leader_address=leader_address)
        async with _router(_token_stream(2, pace_s=0.001), scheduler=standby) as (router, _):
            call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2,
                                                              request_id="r9"))
            assert sum(len(m.token_ids) for m in [m async for m in call]) == 2
            notice = await asyncio.wait_for(leader.finished.get(), 10)
    assert notice.request_id == "r9" and notice.outcome == scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED


def _one_token_then_the_last_at(release: asyncio.Event) -> NodeHandler:
    """A node that sends token 97, then token 98 with the finish once release is set."""

    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        yield _started()
        yield Chunk(node_id=NODE, index=0, token_ids=[97])
        await release.wait()
        yield Chunk(node_id=NODE, index=1, token_ids=[98], finish_reason=common_pb2.FINISH_REASON_LENGTH)

    return generate


async def test_a_request_sent_twice_keeps_its_admission_slot_until_its_last_stream_ends() -> None:
    """Both streams of one request id hold one slot at the leader; the first to end released it, so a refused
    duplicate let a tenant at its concurrency limit start another request (a live probe ran four under a limit of
    one)."""
    release = asyncio.Event()
    generate = _one_token_then_the_last_at(release)

    async with _router(generate) as (router, scheduler):
        request = router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2, request_id="twice")
        first = router.Generate(request)
        assert list((await first.read()).token_ids) == [97]
        resent = router_pb2.GenerateRequest()
        resent.CopyFrom(request)
        resent.resume.SetInParent()  # sent again before a token reached its client (a fresh one is refused: below)
        second = router.Generate(resent)
        assert list((await second.read()).token_ids) == [97]
        second.cancel()  # as a duplicate the node refuses: it ends while the first runs
        told = await asyncio.wait_for(scheduler.finished.get(), 10)
        assert (told.request_id, told.another_stream_live) == ("twice", True)
        release.set()
        last = await first.read()
        assert list(last.token_ids) == [98] and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        told = await asyncio.wait_for(scheduler.finished.get(), 10)
        assert (told.request_id, told.another_stream_live) == ("twice", False)


async def test_the_leader_is_told_the_digest_of_a_requests_own_prompt_the_same_for_its_resume() -> None:
    """So that it can tell a resend of a running id from another request sent under it with `resume`."""
    release = asyncio.Event()
    release.set()
    async with _router(_one_token_then_the_last_at(release)) as (router, scheduler):
        for request in (router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2, request_id="a"),
                        router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2, request_id="b",
                                                   resume=router_pb2.Resume(token_ids=[97], elapsed_ms=10)),
                        router_pb2.GenerateRequest(model=MODEL, prompt="ho", max_tokens=2, request_id="c")):
            [_ async for _ in router.Generate(request)]
    first, resumed, other = (p.prompt_digest for p in scheduler.places)
    assert first and first == resumed and other != first


async def test_a_fresh_request_for_an_id_this_router_runs_is_refused_as_a_duplicate() -> None:
    """Sent again without `resume` while its first stream runs, it ran a second time beside the first on another
    node (only the node running it refused it), on one admission slot, past its tenant's limits (helper-108 ran three
    under a concurrency limit of one). The router refuses it, naming the id; the first stream runs on, and its slot
    is not given up by the refusal."""
    release = asyncio.Event()
    generate = _one_token_then_the_last_at(release)

    async with _router(generate) as (router, scheduler):
        request = router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2, request_id="dup")
        first = router.Generate(request)
        assert list((await first.read()).token_ids) == [97]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await router.Generate(request).read()
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "request_id='dup': is already running" in refused.value.details()
        assert scheduler.finished.empty() and len(scheduler.places) == 1
        release.set()
        last = await first.read()
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        told = await asyncio.wait_for(scheduler.finished.get(), 10)
        assert (told.request_id, told.another_stream_live) == ("dup", False)
        assert list((await router.Generate(request).read()).token_ids) == [97]  # once it ended, the id is free


@pytest.mark.parametrize("ending", [Aborted, AlreadyExists])
async def test_a_stream_its_node_says_another_of_its_id_runs_leaves_the_admission_slot_to_that_one(
        ending: type[BatonError]) -> None:
    """A router that froze wakes to find its node stream ended ABORTED: its client resumed through another router,
    whose stream took this one's place on the node and holds the request's slot. Or the node refuses a request id it
    is already running (ALREADY_EXISTS), for a stream of it through another router. The notice said nothing of
    either, so the leader freed the slot, and the tenant could run one over its concurrency limit (a live check ran
    three under a limit of one, each request's id sent again through the other router)."""

    async def other_stream(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        yield _started()
        yield Chunk(node_id=NODE, index=0, token_ids=[97])
        raise ending(f"request {request.request_id}: another stream of it runs on node {NODE}")

    async with _router(other_stream) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=8, request_id="r"))
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async for _ in call:
                pass
        assert ended.value.code() == ending.code
        told = await asyncio.wait_for(scheduler.finished.get(), 10)
    assert (told.request_id, told.another_stream_live) == ("r", True)
    assert [p.retry_cause for p in scheduler.places] == [""]  # not taken for a node failure: not moved


class _RefusingScheduler(_FakeScheduler):
    """Refuses every Place with the error it is given."""

    def __init__(self, error: BatonError) -> None:
        super().__init__()
        self.error = error

    async def Place(self, request, context):  # noqa: N802
        self.places.append(request)
        await abort(context, self.error)


@pytest.mark.parametrize(("error", "workflow_id", "is_task"), [
    (InvalidArgument("deadline_ms", 1100, "cannot be met: ... on an idle node"), "", False),
    (InvalidArgument("deadline_ms", 1100, "cannot be met: ... on an idle node"), "w", True),
    (ResourceExhausted("tenant t: at its concurrency limit", retry_after_ms=1000), "", True),
    # A duplicate of an id that runs, or an ask its resend took the place of: the id's other stream is its task.
    (AlreadyExists("request_id='r': is already running, through another router"), "", False),
    (Aborted("request_id='r': its client sent it again, through another router"), "", False),
])
@pytest.mark.timeout(30)
async def test_a_request_the_leader_refuses_as_bad_input_is_no_task_and_one_it_refuses_for_load_is_a_failed_one(
        error: BatonError, workflow_id: str, is_task: bool) -> None:
    """The router's own refusals of bad input were no tasks, the leader's were failed tasks, open for
    --task-timeout-s: whether a 400 counted depended on which service refused it. A refusal for the fleet's load or
    a tenant's limit is still a failed task (the client may send the id again and succeed), and so is a workflow's
    step refused as bad input: its workflow failed (unreported, one without total_steps counted as succeeded)."""
    scheduler = _RefusingScheduler(error)
    async with _router(lambda request: _never(), scheduler) as (router, _):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3,
                                                                      request_id="r", workflow_id=workflow_id,
                                                                      step=2 if workflow_id else 0)):
                pass
        assert refused.value.code() == error.code
    # The router has closed: every notice it would send has gone out.
    notices = [scheduler.finished.get_nowait() for _ in range(scheduler.finished.qsize())]
    assert [(n.request_id, n.outcome) for n in notices] == (
        [("r", scheduler_pb2.REQUEST_OUTCOME_FAILED)] if is_task else [])


async def _never() -> AsyncIterator[Chunk]:
    raise AssertionError("no node is asked")
    yield


@pytest.mark.timeout(30)
async def test_a_leaders_deadline_exceeded_for_a_resumed_stream_reaches_its_client_at_once() -> None:
    """The leader ends a resumed stream that cannot end in what it has left with DEADLINE_EXCEEDED; the router took
    that for its own call to the leader timing out, waited --leader-wait-s for another leader and answered
    UNAVAILABLE, retryable and false (helper-101). A status the leader sent on purpose carries its origin."""
    scheduler = _RefusingScheduler(LeftOutOfReach("deadline_ms=900: cannot be met in what the resumed stream has "
                                                  "left"))
    resume = router_pb2.Resume(token_ids=[97, 98], elapsed_ms=100)
    async with _router(lambda request: _never(), scheduler, leader_wait_s=30.0) as (router, _):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in router.Generate(router_pb2.GenerateRequest(
                    model=MODEL, prompt="hi", max_tokens=4, request_id="r", resume=resume, deadline_ms=60_000)):
                pass
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "cannot be met in what the resumed stream has left" in (failed.value.details() or "")
    assert len(scheduler.places) == 1


class _MoveOutOfReachScheduler(_FakeScheduler):
    """Places the first attempt on the one node; ends its move, as the leader ends one that cannot end in what its
    deadline has left."""

    async def Place(self, request, context):  # noqa: N802
        self.places.append(request)
        if request.retry_cause:
            await abort(context, LeftOutOfReach(f"deadline_ms={request.context.deadline_ms}: cannot be met in what "
                                                "the resumed stream has left"))
        return scheduler_pb2.Placement(node_id=NODE, address=self.node_address)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("deadline_ms", [60_000, 0])
async def test_a_move_asks_with_what_is_left_of_its_deadline_and_ends_when_the_leader_says_it_is_out_of_reach(
        deadline_ms: int) -> None:
    """Asked with the whole deadline, 16 of 18 streams moved off a dead host were placed, prefilled again on the
    survivors and ended at their deadlines (helper-195). The move asks with what is left; the leader's
    DEADLINE_EXCEEDED reaches the client at once, after the tokens it had."""
    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        yield _started()
        yield Chunk(node_id=NODE, index=0, token_ids=[97])
        await asyncio.sleep(0.01)  # 10 ms of the deadline pass on the first node (not synchronisation)
        raise RuntimeError("the node died")

    tokens: list[int] = []
    async with _router(generate, _MoveOutOfReachScheduler()) as (router, scheduler):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for message in router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=4,
                                                                            deadline_ms=deadline_ms)):
                tokens.extend(message.token_ids)
    assert tokens == [97]
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "cannot be met in what the resumed stream has left" in (failed.value.details() or "")
    assert [p.retry_cause for p in scheduler.places] == ["", "stream_broken"]
    first, move = (p.context.deadline_ms for p in scheduler.places)
    assert first == deadline_ms
    assert (0 < move <= deadline_ms - 10) if deadline_ms else move == 0


class _NotInOfficeAtFirstScheduler(_MoveOutOfReachScheduler):
    """As _MoveOutOfReachScheduler, but the first move finds the leader elected and not yet in office."""

    async def Place(self, request, context):  # noqa: N802
        if request.retry_cause and not any(p.retry_cause for p in self.places):
            self.places.append(request)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not in office yet")
        return await super().Place(request, context)


@pytest.mark.timeout(30)
async def test_a_move_asked_again_of_a_leader_not_yet_in_office_asks_with_what_is_left_then() -> None:
    """Set once a round of asks, what was left of the deadline reached a leader elected seconds later as it was
    before (helper-204): every call goes out with what is left as it goes."""
    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        yield _started()
        yield Chunk(node_id=NODE, index=0, token_ids=[97])
        raise RuntimeError("the node died")

    async with _router(generate, _NotInOfficeAtFirstScheduler(), leader_wait_s=30.0) as (router, scheduler):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=4,
                                                                      deadline_ms=60_000)):
                pass
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    first, again = (p.context.deadline_ms for p in scheduler.places if p.retry_cause)
    assert again <= first - 50  # the router waited at least 50 ms before it asked that leader again


@pytest.mark.timeout(30)
async def test_a_move_from_a_node_that_never_had_the_request_recomputes_nothing() -> None:
    """The first node froze before the request reached it (it said nothing on the stream): its move's node prefills
    the prompt for the first time, and recomputed_tokens counted all of it as computed again."""
    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        if scheduler.places[-1].retry_cause == "":
            await asyncio.Event().wait()  # the first node: silent until the router gives up on it
        context = len(request.prompt_token_ids)
        yield _started()
        yield Chunk(node_id=NODE, index=0, token_ids=[97], finish_reason=common_pb2.FINISH_REASON_LENGTH,
                    checkpoint=node_agent_pb2.Checkpoint(num_context_tokens=context + 1, num_completion_tokens=1,
                                                         num_cached_tokens=0),
                    usage=common_pb2.Usage(prompt_tokens=context, completion_tokens=1))

    scheduler = _MovingScheduler()
    async with _router(generate, scheduler, stall_floor_s=0.2) as (router, _):
        messages = [m async for m in router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi",
                                                                                 max_tokens=1))]
    usage = messages[-1].usage
    assert usage.num_migrations == 1 and usage.recomputed_tokens == 0


# Stop strings in the text. A node matches a stop by the tokens of the string alone; a byte-level BPE model writes
# "be" inside " be" and "e i" across " be", " if", so the node never stops there (found live on vLLM): the router
# looks for the stop in the text and ends the generation itself.
_BE, _IF = token_ids(b" be", b" if")


def _be_if_forever(closed: asyncio.Event, dies_after: int = 0) -> NodeHandler:
    """A node generating " be if be if ..." that matches no stop string and never finishes, so only its router can end
    the stream (closed is set when it does). Its first attempt dies after dies_after tokens, if not 0."""

    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        resumed, context = request.num_resumed_tokens, len(request.prompt_token_ids)
        try:
            yield _started()
            for i in range(request.sampling.max_tokens):
                if dies_after and not resumed and i == dies_after:
                    raise RuntimeError("the node died")
                yield Chunk(node_id=NODE, index=i, token_ids=[_BE if (resumed + i) % 2 == 0 else _IF],
                            checkpoint=node_agent_pb2.Checkpoint(num_context_tokens=context + i + 1,
                                                                 num_completion_tokens=i + 1, gpu_ms=1.5 * (i + 1),
                                                                 num_cached_tokens=1))
            await asyncio.Event().wait()  # its finish would come later, if ever
        finally:
            closed.set()

    return generate


@pytest.fixture
def pieces_model(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """_router's arguments for a model whose tokens are several bytes (tests/unit/piece_tokenizer.py)."""
    monkeypatch.setitem(TOKENIZERS, "pieces", PieceTokenizer())
    return {"tokenizer": "pieces", "vocab_size": VOCAB_SIZE}


async def test_a_stop_string_inside_the_tokens_ends_the_stream_at_the_token_completing_it(
        pieces_model: dict[str, object]) -> None:
    closed = asyncio.Event()
    async with _router(_be_if_forever(closed), **pieces_model) as (router, scheduler):  # type: ignore[arg-type]
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt=" if", max_tokens=40, stop=["e i"]))
        messages = await asyncio.wait_for(_all(call), 10)
        notice = await asyncio.wait_for(scheduler.finished.get(), 10)
        await asyncio.wait_for(closed.wait(), 10)  # the node's stream closed: it stops generating
    assert [t for m in messages for t in m.token_ids] == [_BE, _IF]  # through the token completing the stop
    assert "".join(m.text for m in messages) == " be i"  # the stop kept, not what its last token has after it
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert messages[-1].usage.completion_tokens == 2 and messages[-1].usage.gpu_ms == 3.0
    assert messages[-1].usage.cached_tokens == 1
    assert notice.outcome == scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED
    assert notice.num_output_tokens == 2 and dict(notice.gpu_ms_by_node) == {NODE: 3.0}


@pytest.mark.parametrize(("stop", "tokens", "text", "placed"), [
    # Wholly in the resumed " be if": the stream ended there (its router died before the finish reached the client),
    # and it ends at once with no node asked; it ran on to max_tokens (helper-109, a raw gRPC resume).
    ("e i", [], "", False),
    ("f be", [_BE], " be", True),  # begun in the resumed text, ended in the new
])
async def test_a_resumed_stream_stops_on_a_stop_it_completes_and_at_once_on_one_among_its_resumed_tokens(
        pieces_model: dict[str, object], stop: str, tokens: list[int], text: str, placed: bool) -> None:
    closed = asyncio.Event()
    async with _router(_be_if_forever(closed), **pieces_model) as (router, scheduler):  # type: ignore[arg-type]
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt=" if", max_tokens=40, stop=[stop],
                                                          resume=router_pb2.Resume(token_ids=[_BE, _IF])))
        messages = await asyncio.wait_for(_all(call), 10)
        notice = await asyncio.wait_for(scheduler.finished.get(), 10)
    assert [t for m in messages for t in m.token_ids] == tokens and "".join(m.text for m in messages) == text
    assert messages[0].index == 2 and messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert notice.outcome == scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED and bool(scheduler.places) == placed


async def test_a_stop_string_spanning_a_move_between_nodes_ends_the_stream_on_the_new_node(
        pieces_model: dict[str, object]) -> None:
    closed = asyncio.Event()
    async with _router(_be_if_forever(closed, dies_after=1), _MovingScheduler(),
                       **pieces_model) as (router, scheduler):  # type: ignore[arg-type]
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt=" if", max_tokens=40, stop=["e i"]))
        messages = await asyncio.wait_for(_all(call), 10)
        notice = await asyncio.wait_for(scheduler.finished.get(), 10)
    assert [t for m in messages for t in m.token_ids] == [_BE, _IF] and "".join(m.text for m in messages) == " be i"
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP and messages[-1].usage.num_migrations == 1
    assert notice.outcome == scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED and notice.num_output_tokens == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_the_http_api_shows_the_text_up_to_a_stop_that_ends_inside_a_token(
        pieces_model: dict[str, object], stream: bool) -> None:
    """OpenAI's text excludes the stop, and nothing its last token carries after it comes out."""
    closed = asyncio.Event()
    async with _router(_be_if_forever(closed), **pieces_model) as (_, scheduler):  # type: ignore[arg-type]
        assert scheduler.router is not None
        http = TestClient(TestServer(HttpApi(scheduler.router, "127.0.0.1:0", InputLimits()).app))
        await http.start_server()
        try:
            body = {"model": MODEL, "prompt": " if", "max_tokens": 40, "stop": ["e i"], "stream": stream}
            response = await asyncio.wait_for(http.post("/v1/completions", json=body), 10)
            if stream:
                lines = [line for line in (await response.text()).splitlines() if line.startswith("data: {")]
                choices = [json.loads(line.removeprefix("data: "))["choices"][0] for line in lines]
            else:
                choices = (await response.json())["choices"]
        finally:
            await http.close()
    assert "".join(choice["text"] for choice in choices) == " b"
    assert choices[-1]["finish_reason"] == "stop"


async def _all(call: AsyncIterator[router_pb2.GenerateChunk]) -> list[router_pb2.GenerateChunk]:
    return [message async for message in call]


@pytest.mark.parametrize(("hint_ms", "moves"), [(50, True), (31_000, False)])
async def test_a_move_the_retry_budget_holds_back_waits_for_it_and_then_moves(hint_ms: int, moves: bool) -> None:
    """A move refused RESOURCE_EXHAUSTED (the cluster's retry budget spent by the other streams of a dead node) ended
    its stream UNAVAILABLE, the generation lost, though the budget frees up within its window (helper-167). The
    router waits out the leader's hint, within the client's deadline and MOVE_WAIT_S in all."""

    class _Budgeted(_MovingScheduler):
        async def Place(self, request, context):  # noqa: N802
            if request.retry_cause and not any(p.retry_cause for p in self.places):
                self.places.append(request)
                await abort(context, ResourceExhausted("cluster retry budget exhausted", hint_ms))
            return await super().Place(request, context)

    async def generate(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        yield _started()
        yield Chunk(node_id=NODE, index=0, token_ids=[97 + request.num_resumed_tokens],
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if request.num_resumed_tokens else 0)
        if not request.num_resumed_tokens:
            raise RuntimeError("the node died")

    async with _router(generate, _Budgeted()) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2))
        if not moves:  # a hint beyond MOVE_WAIT_S
            assert hint_ms > MOVE_WAIT_S * 1000
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await _collect(call)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "could not move it" in (failed.value.details() or "")
            assert [p.retry_cause for p in scheduler.places] == ["", "stream_broken"]
            return
        messages = await _collect(call)
    assert [t for m in messages for t in m.token_ids] == [97, 98]
    assert [p.retry_cause for p in scheduler.places] == ["", "stream_broken", "stream_broken"]
    # Each Place says which process of the router asks (a restarted one frees its dead predecessor's slots).
    assert len({p.router_incarnation for p in scheduler.places}) == 1 and scheduler.places[0].router_incarnation


async def test_a_request_refused_as_invalid_is_found_in_the_traces_by_its_id() -> None:
    """Refused before it was valid (top_p out of range), its span carried no request id (helper-197)."""
    telemetry, spans = _traced()
    async with _router(_two_tokens(dies_first=False), _FakeScheduler(), telemetry=telemetry) as (router, _):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2, top_p=2.0,
                                                          request_id="job-11"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            _ = [m async for m in call]
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    served = [s for s in spans.get_finished_spans() if s.name == "/baton.v1.Router/Generate"]
    assert len(served) == 1 and served[0].attributes is not None
    assert served[0].attributes["baton.request_id"] == "job-11"
