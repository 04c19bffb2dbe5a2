"""A node that refuses a resume because it runs another stream of the id (a frozen router's) that the resume cannot
take over is well: its router runs the resume elsewhere without taking that node for failed. Before, the refusal was a
node failure to the router: the node a suspect for every other client's placements for --suspect-s, a move counted in
baton.router.migrations and the request's num_migrations."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from baton.protocol import ORIGIN_KEY, STREAM_HELD_KEY
from baton.v1 import common_pb2, node_agent_pb2, router_pb2, scheduler_pb2
from services.common.errors import StreamHeld, Unavailable, abort
from services.common.telemetry import Telemetry
from tests.unit.test_router_stream import MODEL, NODE, Chunk, _counted, _FakeScheduler, _router, _started

pytestmark = pytest.mark.timeout(60)

HOLDER = "node-1"  # runs another stream of request "r", which a resume of it cannot take over


class _Holding:
    """The fake node's handler, as the node the request was placed on (placed_on): holder refuses request "r" as a
    node refuses a resume it cannot take over; any other request, or "r" on another node, gets two tokens."""

    def __init__(self, holder: str) -> None:
        self.holder = self.placed_on = holder

    async def __call__(self, request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        node_id = self.placed_on
        if request.request_id == "r" and node_id == self.holder:
            raise StreamHeld(f"request_id='r': an earlier stream of it still runs on node {node_id}, which this "
                             "resume cannot take over: sampling.max_tokens=9 takes it to 12 tokens, past the 10 that "
                             "stream could reach", node_id)
        yield _started()
        yield Chunk(node_id=node_id, index=0, token_ids=[99])
        yield Chunk(node_id=node_id, index=1, token_ids=[100], finish_reason=common_pb2.FINISH_REASON_LENGTH)


class _TwoNodes(_FakeScheduler):
    """Places each attempt on the first of HOLDER and node-2 not excluded (both served by the one fake node)."""

    def __init__(self) -> None:
        super().__init__()
        self.handler = _Holding(HOLDER)

    async def Place(  # noqa: N802
        self, request: scheduler_pb2.PlaceRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Placement:
        self.places.append(request)
        free = [n for n in (HOLDER, "node-2") if n not in request.exclude_node_ids]
        if not free:
            await abort(context, Unavailable(f"model={request.model!r}: no live node has it warm"))
        self.handler.placed_on = free[0]
        return scheduler_pb2.Placement(node_id=free[0], address=self.node_address)


def _metered() -> tuple[Telemetry, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    telemetry = Telemetry("router/test", "none")
    telemetry.meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    return telemetry, reader


async def test_a_resume_its_node_will_not_take_runs_on_another_node_and_that_node_stays_a_candidate() -> None:
    scheduler = _TwoNodes()
    telemetry, reader = _metered()
    resume = router_pb2.Resume(token_ids=[97, 98], elapsed_ms=100)
    async with _router(scheduler.handler, scheduler, telemetry=telemetry) as (router, _):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=4, request_id="r",
                                                          resume=resume))
        messages = [m async for m in call]
        told = await asyncio.wait_for(scheduler.finished.get(), 10)
        # Another client's request, next: the node that refused is no suspect, so its placement avoids nothing.
        other = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2, request_id="s"))
        assert sum(len(m.token_ids) for m in [m async for m in other]) == 2
    assert [t for m in messages for t in m.token_ids] == [99, 100]
    assert [m.node_id for m in messages if m.token_ids] == ["node-2", "node-2"]
    assert messages[-1].usage.num_migrations == 0
    assert [(p.request_id, list(p.exclude_node_ids), p.retry_cause) for p in scheduler.places] == [
        ("r", [], ""), ("r", [HOLDER], ""), ("s", [], "")]
    assert _counted(reader, "baton.router.migrations") == []
    # The node said another stream of the id runs there: the leader keeps their admission slot for it.
    assert (told.request_id, told.another_stream_live) == ("r", True)


async def test_a_resume_no_node_can_take_is_unavailable_naming_the_request_and_the_node_that_holds_it() -> None:
    telemetry, reader = _metered()
    resume = router_pb2.Resume(token_ids=[97, 98], elapsed_ms=100)
    async with _router(_Holding(NODE), telemetry=telemetry) as (router, scheduler):
        call = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=4, request_id="r",
                                                          resume=resume))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in call:
                pass
        told = await asyncio.wait_for(scheduler.finished.get(), 10)
        other = router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2, request_id="s"))
        assert sum(len(m.token_ids) for m in [m async for m in other]) == 2
    # Retryable once that stream ends, said as a status of Baton's own (the client SDK does not take it for its
    # router's death and resend it), with the same machine-readable mark as the node's.
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    details = refused.value.details() or ""
    assert details.startswith(f"request_id='r': an earlier stream of it still runs on node {NODE}, which this "
                              "resume cannot take over: sampling.max_tokens=9")
    assert "; no other node could take it: " in details
    metadata = dict(refused.value.trailing_metadata() or ())
    assert metadata.get(STREAM_HELD_KEY) == NODE and ORIGIN_KEY in metadata
    # Placed again without the node that holds the stream (nothing left), and no move asked for; the next request
    # is placed with nothing avoided, at once.
    assert [(p.request_id, list(p.exclude_node_ids), p.retry_cause) for p in scheduler.places] == [
        ("r", [], ""), ("r", [NODE], ""), ("s", [], "")]
    assert _counted(reader, "baton.router.migrations") == []
    assert (told.request_id, told.another_stream_live) == ("r", True)


class _NodeOneThenTwo(_FakeScheduler):
    """Places on node-1, then node-2, and has no node left past those two."""

    def __init__(self) -> None:
        super().__init__()
        self.placed_on = ""

    async def Place(self, request, context):  # noqa: N802
        self.places.append(request)
        free = [n for n in ("node-1", "node-2") if n not in request.exclude_node_ids]
        if not free:
            await abort(context, Unavailable("no live node for the model"))
        self.placed_on = free[0]
        return scheduler_pb2.Placement(node_id=free[0], address=self.node_address)


async def test_a_move_that_a_node_refuses_and_finds_no_other_node_names_the_failure_and_the_refusal() -> None:
    """node-1 fails after a token; the move's node, node-2, runs another stream of the id: the client hears both
    (the refusal was left out of the message, so a client saw only the failure and "no node")."""
    scheduler = _NodeOneThenTwo()

    async def handler(request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[Chunk]:
        node_id = scheduler.placed_on
        if node_id == "node-1":
            yield _started()
            yield Chunk(node_id=node_id, index=0, token_ids=[99])
            raise Unavailable("node-1 broke")  # unmarked: a node failure
        raise StreamHeld("request_id='r': an earlier stream of it still runs here", node_id)

    async with _router(handler, scheduler) as (router, _):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in router.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=3,
                                                                      request_id="r")):
                pass
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    details = failed.value.details() or ""
    assert "could not move it" in details and "node node-2: request_id='r': an earlier stream" in details
    # One move, charged once per placement that asked for it: the leader saw the move's cause on both.
    assert [p.retry_cause for p in scheduler.places] == ["", "stream_broken", "stream_broken"]
    # Its router says who it is on each Place and on the notice: the leader counts the routers holding the id's slot.
    notice = await asyncio.wait_for(scheduler.finished.get(), 5)
    assert notice.router_id and {p.router_id for p in scheduler.places} == {notice.router_id}
