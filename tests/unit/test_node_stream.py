"""A watched node stream: which chunks pass, and which node failures (or request errors) it becomes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from baton.v1 import common_pb2, node_agent_pb2, node_agent_pb2_grpc
from services.common.errors import BatonError
from services.router.generation import FailureCause, NodeFailure
from services.router.node_stream import NodeLiveness, _read_out, watched_stream
from services.router.stall import NodeActivity, stall_deadline_s

NODE = "node-a"
REQUEST = node_agent_pb2.NodeGenerateRequest(
    request_id="r1",
    model="m",
    prompt_token_ids=[1, 2, 3],
    sampling=common_pb2.SamplingParams(max_tokens=4),
)

Chunk = node_agent_pb2.NodeGenerateChunk
Handler = Callable[[node_agent_pb2.NodeGenerateRequest, grpc.aio.ServicerContext], AsyncIterator[Chunk]]


# --- NodeLiveness -------------------------------------------------------------------------------


def _counter() -> tuple[list[int], Callable[[], None]]:
    calls: list[int] = []
    return calls, lambda: calls.append(1)


def test_callback_fires_when_a_present_node_leaves() -> None:
    liveness = NodeLiveness()
    liveness.update({"a", "b"})
    calls, callback = _counter()
    liveness.on_gone("a", callback)
    liveness.update({"a", "b", "c"})
    liveness.update({"b"})
    assert len(calls) == 1


def test_callback_does_not_fire_for_another_node_leaving() -> None:
    liveness = NodeLiveness()
    liveness.update({"a", "b"})
    calls, callback = _counter()
    liveness.on_gone("a", callback)
    liveness.update({"a"})
    assert calls == []


def test_callback_does_not_fire_for_a_node_never_seen() -> None:
    liveness = NodeLiveness()
    calls, callback = _counter()
    liveness.on_gone("ghost", callback)
    liveness.update(set())
    liveness.update({"a"})
    liveness.update(set())
    assert calls == []


def test_callback_does_not_fire_after_cancel() -> None:
    liveness = NodeLiveness()
    liveness.update({"a"})
    calls, callback = _counter()
    cancel = liveness.on_gone("a", callback)
    cancel()
    liveness.update(set())
    assert calls == []


def test_cancel_removes_only_its_own_callback() -> None:
    liveness = NodeLiveness()
    liveness.update({"a"})
    first_calls, first = _counter()
    second_calls, second = _counter()
    cancel_first = liveness.on_gone("a", first)
    liveness.on_gone("a", second)
    cancel_first()
    liveness.update(set())
    assert (first_calls, len(second_calls)) == ([], 1)


def test_callback_fires_once_per_departure() -> None:
    liveness = NodeLiveness()
    liveness.update({"a"})
    calls, callback = _counter()
    liveness.on_gone("a", callback)
    liveness.update(set())
    liveness.update(set())
    assert len(calls) == 1
    liveness.update({"a"})
    liveness.update({"b"})
    assert len(calls) == 2


def test_cancelling_twice_leaves_later_registrations_alone() -> None:
    liveness = NodeLiveness()
    liveness.update({"a"})
    _, first = _counter()
    cancel_first = liveness.on_gone("a", first)
    cancel_first()
    calls, second = _counter()
    liveness.on_gone("a", second)
    cancel_first()
    liveness.update(set())
    assert len(calls) == 1


# --- stall deadline -----------------------------------------------------------------------------


def test_stall_deadline_is_the_floor_before_the_node_announces_its_pace() -> None:
    assert stall_deadline_s(0.5, None) == 0.5


@pytest.mark.parametrize(
    ("heartbeat_ms", "step_ms", "expected_s"),
    [
        (100, 10.0, 0.5),  # both below the floor
        (300, 10.0, 0.9),  # three heartbeats
        (100, 80.0, 0.8),  # ten steps
        (1000, 500.0, 5.0),  # ten slow steps beat three heartbeats
    ],
)
def test_stall_deadline_follows_the_announced_pace(heartbeat_ms: int, step_ms: float, expected_s: float) -> None:
    started = node_agent_pb2.StreamStarted(heartbeat_interval_ms=heartbeat_ms, expected_step_ms=step_ms)
    assert stall_deadline_s(0.5, started) == pytest.approx(expected_s)


# --- watched_stream against an in-process node --------------------------------------------------


class _FakeNode(node_agent_pb2_grpc.NodeAgentServicer):
    """A node agent whose Generate stream is whatever the test's handler yields."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def Generate(  # noqa: N802 (the generated servicer's name)
        self, request: node_agent_pb2.NodeGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Chunk]:
        async for chunk in self.handler(request, context):
            yield chunk


@contextlib.asynccontextmanager
async def _node(handler: Handler) -> AsyncIterator[grpc.aio.Channel]:
    """A fake node on a free 127.0.0.1 port and a channel to it; both stopped on exit."""
    server = grpc.aio.server()
    node_agent_pb2_grpc.add_NodeAgentServicer_to_server(_FakeNode(handler), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(0)


def _started(heartbeat_ms: int = 10, step_ms: float = 1.0) -> Chunk:
    started = node_agent_pb2.StreamStarted(heartbeat_interval_ms=heartbeat_ms, expected_step_ms=step_ms)
    return Chunk(request_id="r1", node_id=NODE, started=started)


def _tokens(index: int, *token_ids: int) -> Chunk:
    return Chunk(request_id="r1", node_id=NODE, token_ids=token_ids, index=index)


def _finish(index: int, *token_ids: int) -> Chunk:
    return Chunk(
        request_id="r1",
        node_id=NODE,
        token_ids=token_ids,
        index=index,
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=index + len(token_ids)),
    )


def _heartbeat() -> Chunk:
    return Chunk(request_id="r1", node_id=NODE)


async def _collect(
    channel: grpc.aio.Channel,
    liveness: NodeLiveness | None = None,
    stall_floor_s: float = 30.0,
    on_chunk: Callable[[Chunk], None] | None = None,
) -> list[Chunk]:
    """Every chunk watched_stream yields, until it ends or raises."""
    chunks: list[Chunk] = []
    stream = watched_stream(channel, NODE, REQUEST, liveness or NodeLiveness(), stall_floor_s, timeout_s=None)
    async with contextlib.aclosing(stream):
        async for chunk in stream:
            chunks.append(chunk)
            if on_chunk is not None:
                on_chunk(chunk)
    return chunks


async def _node_failure(run: Awaitable[list[Chunk]]) -> NodeFailure:
    with pytest.raises(NodeFailure) as caught:
        async with asyncio.timeout(5):
            await run
    assert caught.value.node_id == NODE
    return caught.value


async def test_token_chunks_pass_through_and_the_stream_ends_at_the_finish() -> None:
    async def generate(request: node_agent_pb2.NodeGenerateRequest, context: object) -> AsyncIterator[Chunk]:
        assert list(request.prompt_token_ids) == [1, 2, 3]
        yield _started()
        yield _heartbeat()
        yield _tokens(0, 97, 98)
        yield _heartbeat()
        yield _tokens(2, 99)
        yield _finish(3, 100)
        yield _tokens(4, 101)  # after the finish: never read

    async with _node(generate) as channel, asyncio.timeout(5):
        chunks = await _collect(channel)
    assert [list(chunk.token_ids) for chunk in chunks] == [[97, 98], [99], [100]]
    assert [chunk.index for chunk in chunks] == [0, 2, 3]
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].usage.completion_tokens == 4
    assert not any(chunk.HasField("started") for chunk in chunks)


async def test_a_finish_without_tokens_is_passed_through() -> None:
    async def generate(request: object, context: object) -> AsyncIterator[Chunk]:
        yield _started()
        yield _tokens(0, 97)
        yield _finish(1)

    async with _node(generate) as channel, asyncio.timeout(5):
        chunks = await _collect(channel)
    assert [list(chunk.token_ids) for chunk in chunks] == [[97], []]
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_a_node_that_goes_silent_after_starting_is_stalled() -> None:
    never = asyncio.Event()

    async def generate(request: object, context: object) -> AsyncIterator[Chunk]:
        yield _started(heartbeat_ms=10, step_ms=1.0)
        yield _tokens(0, 97)
        await never.wait()
        yield _finish(1, 98)

    received: list[Chunk] = []
    async with _node(generate) as channel:
        failure = await _node_failure(_collect(channel, stall_floor_s=0.2, on_chunk=received.append))
    assert failure.cause is FailureCause.STALLED
    assert [list(chunk.token_ids) for chunk in received] == [[97]]
    # The announced pace (30 ms of heartbeats, 10 ms of steps) is below the floor: the floor decides.
    # Read from the failure, not timed: a wall-clock bound on the wait failed once in a full unit run.
    assert "deadline 0.20s" in str(failure)


async def test_a_node_that_never_sends_anything_is_stalled_after_the_floor() -> None:
    never = asyncio.Event()

    async def generate(request: object, context: object) -> AsyncIterator[Chunk]:
        await never.wait()
        yield _started()

    async with _node(generate) as channel:
        failure = await _node_failure(_collect(channel, stall_floor_s=0.2))
    assert failure.cause is FailureCause.STALLED


async def test_heartbeats_keep_a_slow_node_from_counting_as_stalled() -> None:
    async def generate(request: object, context: object) -> AsyncIterator[Chunk]:
        yield _started(heartbeat_ms=50, step_ms=1.0)
        for _ in range(12):  # 0.6 s of heartbeats, three times the stall floor
            await asyncio.sleep(0.05)
            yield _heartbeat()
        yield _finish(0, 97)

    async with _node(generate) as channel, asyncio.timeout(5):
        chunks = await _collect(channel, stall_floor_s=0.2)
    assert [list(chunk.token_ids) for chunk in chunks] == [[97]]
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_a_stream_not_answered_yet_by_a_node_busy_with_others_is_not_stalled() -> None:
    """Issue 15.5: in a burst, a stream the node is slow to answer while it answers others is the
    node being busy, not dead (it used to be declared stalled after the floor)."""
    answer_late = asyncio.Event()

    async def generate(request: node_agent_pb2.NodeGenerateRequest, context: object) -> AsyncIterator[Chunk]:
        if request.request_id == "late":
            await answer_late.wait()
            yield _started()
            yield _finish(0, 97)
            return
        yield _started(heartbeat_ms=50)
        for _ in range(16):  # 0.8 s of heartbeats: four stall floors
            await asyncio.sleep(0.05)  # the node's pace, not synchronisation
            yield _heartbeat()
        answer_late.set()
        yield _finish(0, 98)

    activity = NodeActivity()

    async def run(request_id: str) -> list[Chunk]:
        request = node_agent_pb2.NodeGenerateRequest()
        request.CopyFrom(REQUEST)
        request.request_id = request_id
        stream = watched_stream(channel, NODE, request, NodeLiveness(), 0.2, None, activity)
        async with contextlib.aclosing(stream):
            return [chunk async for chunk in stream]

    async with _node(generate) as channel, asyncio.timeout(5):
        late, answered = await asyncio.gather(run("late"), run("answered"))
    assert [list(chunk.token_ids) for chunk in late] == [[97]]
    assert [list(chunk.token_ids) for chunk in answered] == [[98]]


async def test_a_consumer_busy_with_a_chunk_is_not_a_stalled_node() -> None:
    """While the relay holds a chunk (its client is behind) it does not read the node, so silence
    then is not the node's."""
    release = asyncio.Event()

    async def generate(request: object, context: object) -> AsyncIterator[Chunk]:
        yield _started(heartbeat_ms=10)
        yield _tokens(0, 97)
        await release.wait()
        yield _finish(1, 98)

    async with _node(generate) as channel, asyncio.timeout(5):
        stream = watched_stream(channel, NODE, REQUEST, NodeLiveness(), 0.2, None)
        async with contextlib.aclosing(stream):
            first = await anext(stream)
            await asyncio.sleep(0.6)  # the consumer is busy for three stall floors
            release.set()
            rest = [chunk async for chunk in stream]
    assert [list(chunk.token_ids) for chunk in [first, *rest]] == [[97], [98]]


async def test_a_router_whose_loop_stood_still_does_not_take_its_node_for_stalled() -> None:
    """The router's event loop blocked for five stall deadlines (a frozen or starved router; here the loop is held
    with time.sleep, the node's handler with it): its stall check comes late, with the node's next words unread. It
    moved every stream it had with the node; now the silence counts from the late check, and the node is heard."""
    async def generate(request: object, context: object) -> AsyncIterator[Chunk]:
        yield _started(heartbeat_ms=10)
        for _ in range(20):
            await asyncio.sleep(0.02)
            yield _heartbeat()
        yield _finish(0, 97)

    loop = asyncio.get_running_loop()
    async with _node(generate) as channel, asyncio.timeout(10):
        loop.call_later(0.05, time.sleep, 1.0)  # the fault: the whole loop stands still for 1 s
        chunks = await _collect(channel, stall_floor_s=0.2)
    assert [list(chunk.token_ids) for chunk in chunks] == [[97]]


async def test_the_node_leaving_etcd_mid_stream_is_lease_expired() -> None:
    never = asyncio.Event()

    async def generate(request: object, context: object) -> AsyncIterator[Chunk]:
        yield _started()
        yield _tokens(0, 97)
        await never.wait()
        yield _finish(1, 98)

    liveness = NodeLiveness()
    liveness.update({NODE, "node-b"})
    async with _node(generate) as channel:
        failure = await _node_failure(_collect(channel, liveness, on_chunk=lambda chunk: liveness.update({"node-b"})))
    assert failure.cause is FailureCause.LEASE_EXPIRED


async def test_another_node_leaving_does_not_disturb_the_stream() -> None:
    release = asyncio.Event()

    async def generate(request: object, context: object) -> AsyncIterator[Chunk]:
        yield _started()
        yield _tokens(0, 97)
        await release.wait()
        yield _finish(1, 98)

    def on_chunk(chunk: Chunk) -> None:
        liveness.update({NODE})
        release.set()

    liveness = NodeLiveness()
    liveness.update({NODE, "node-b"})
    async with _node(generate) as channel, asyncio.timeout(5):
        chunks = await _collect(channel, liveness, on_chunk=on_chunk)
    assert [list(chunk.token_ids) for chunk in chunks] == [[97], [98]]


async def test_a_node_refusing_the_request_is_the_requests_error_not_a_node_failure() -> None:
    async def generate(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[Chunk]:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens=0: must be positive")
        yield _started()

    async with _node(generate) as channel:
        with pytest.raises(BatonError) as caught:
            async with asyncio.timeout(5):
                await _collect(channel)
    assert not isinstance(caught.value, NodeFailure)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens=0: must be positive" in str(caught.value)


async def test_a_node_failing_after_it_started_is_stream_broken() -> None:
    async def generate(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[Chunk]:
        yield _started()
        yield _tokens(0, 97)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "engine died")

    async with _node(generate) as channel:
        failure = await _node_failure(_collect(channel))
    assert failure.cause is FailureCause.STREAM_BROKEN


async def test_a_stream_that_ends_without_a_finish_is_stream_broken() -> None:
    async def generate(request: object, context: object) -> AsyncIterator[Chunk]:
        yield _started()
        yield _tokens(0, 97)

    async with _node(generate) as channel:
        failure = await _node_failure(_collect(channel))
    assert failure.cause is FailureCause.STREAM_BROKEN


async def test_a_closed_port_is_connect_failed() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        failure = await _node_failure(_collect(channel))
    assert failure.cause is FailureCause.CONNECT_FAILED


async def test_cancelling_the_consumer_is_cancellation_not_a_node_failure() -> None:
    never = asyncio.Event()
    first_chunk = asyncio.Event()

    async def generate(request: object, context: object) -> AsyncIterator[Chunk]:
        yield _started()
        yield _tokens(0, 97)
        await never.wait()
        yield _finish(1, 98)

    async with _node(generate) as channel:
        consumer = asyncio.create_task(_collect(channel, on_chunk=lambda chunk: first_chunk.set()))
        try:
            async with asyncio.timeout(5):
                await first_chunk.wait()
            consumer.cancel()
            with pytest.raises(asyncio.CancelledError):
                async with asyncio.timeout(5):
                    await consumer
        finally:
            consumer.cancel()
    assert consumer.cancelled()


async def test_reading_out_a_call_ends_on_its_cancellation_but_not_on_its_readers() -> None:
    """After cancelling its call the stream reads it out (so the tracing interceptor ends its span): the call's own
    cancellation ends that read, while a cancellation of the reading task must still cancel the task."""

    async def cancelled_call() -> AsyncIterator[node_agent_pb2.NodeGenerateChunk]:
        raise asyncio.CancelledError  # what reading a cancelled gRPC call raises
        yield node_agent_pb2.NodeGenerateChunk()

    await _read_out(cancelled_call())  # taken as the call's end
    started = asyncio.Event()

    async def silent_call() -> AsyncIterator[node_agent_pb2.NodeGenerateChunk]:
        started.set()
        await asyncio.Event().wait()
        yield node_agent_pb2.NodeGenerateChunk()

    reader = asyncio.create_task(_read_out(silent_call()))
    await started.wait()
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
