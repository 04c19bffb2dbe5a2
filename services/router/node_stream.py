"""One node's Generate stream, watched: a broken, stalled or deregistered node becomes NodeFailure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from baton.protocol import DRAINED_KEY, STREAM_HELD_KEY
from baton.v1 import node_agent_pb2, node_agent_pb2_grpc
from services.common.errors import from_rpc_error
from services.common.failure_cause import FailureCause
from services.router.generation import NodeFailure, TakeoverRefused
from services.router.stall import NodeActivity, StallWatch

# A node stream failing with these codes is the node's failure, not the request's.
_NODE_FAILURE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                       grpc.StatusCode.INTERNAL)


def _router_went_unanswered(exc: grpc.aio.AioRpcError) -> bool:
    """The node closed the connection because its pings went unanswered: this router was frozen or cut off (its
    channels to nodes send no pings of their own, so a ping timeout on them is the node's)."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and "ping timeout" in (exc.details() or "")


class NodeLiveness:
    """Nodes as etcd lists them, with callbacks for the moment one leaves."""

    def __init__(self) -> None:
        self._present: set[str] = set()
        self._on_gone: dict[str, set[Callable[[], None]]] = {}

    def update(self, node_ids: set[str]) -> None:
        left = self._present - node_ids
        self._present = set(node_ids)
        for node_id in left:
            for callback in list(self._on_gone.get(node_id, ())):
                callback()

    def on_gone(self, node_id: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call callback if node_id leaves; returns the function that cancels this."""
        callbacks = self._on_gone.setdefault(node_id, set())
        callbacks.add(callback)

        def cancel() -> None:
            callbacks.discard(callback)
            if not callbacks and self._on_gone.get(node_id) is callbacks:
                del self._on_gone[node_id]

        return cancel


async def watched_stream(
    channel: grpc.aio.Channel,
    node_id: str,
    request: node_agent_pb2.NodeGenerateRequest,
    liveness: NodeLiveness,
    stall_floor_s: float,
    timeout_s: float | None,
    activity: NodeActivity | None = None,
) -> AsyncIterator[node_agent_pb2.NodeGenerateChunk]:
    """The node's chunks that carry tokens or a finish; NodeFailure when the node fails us, TakeoverRefused when it
    runs another stream of the request's id that this one cannot take over (it is well: not a failure).

    Silence is only measured while this generator waits on the node: while its consumer holds
    a chunk (a full buffer towards a slow client), the node is not being read and cannot be heard.
    """
    loop = asyncio.get_running_loop()
    activity = activity if activity is not None else NodeActivity()
    call = node_agent_pb2_grpc.NodeAgentStub(channel).Generate(request, timeout=timeout_s)
    failure: FailureCause | None = None
    stalled_because = ""
    watch = StallWatch(node_id, stall_floor_s, activity, loop.time())
    received_any = False

    def fail(cause: FailureCause) -> None:
        nonlocal failure
        if failure is None:
            failure = cause
            call.cancel()

    def check_stall(due: float) -> None:
        nonlocal timer, stalled_because
        now = loop.time()
        why, recheck_s = watch.check(now, late_s=now - due)
        if why is not None:
            stalled_because = why
            fail(FailureCause.STALLED)
        else:
            timer = loop.call_later(recheck_s, check_stall, now + recheck_s)

    activity.open(node_id)
    timer = loop.call_later(watch.deadline_s, check_stall, loop.time() + watch.deadline_s)
    stop_watching = liveness.on_gone(node_id, lambda: fail(FailureCause.LEASE_EXPIRED))
    responses = aiter(call)
    try:
        async for chunk in responses:
            watch.heard(chunk, loop.time())
            received_any = True
            if chunk.token_ids or chunk.finish_reason:
                watch.stop_listening()
                yield chunk
                watch.listen(loop.time())
                if chunk.finish_reason:
                    return
        raise NodeFailure(node_id, FailureCause.STREAM_BROKEN, "stream ended without a finish", received_any)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if failure is None or (current is not None and current.cancelling()):
            raise  # cancelled from outside (the client went away): not a node failure
        raise NodeFailure(node_id, failure, stalled_because, received_any) from None
    except grpc.aio.AioRpcError as exc:
        if failure is not None:
            raise NodeFailure(node_id, failure, stalled_because, received_any) from None
        if exc.code() == grpc.StatusCode.UNAVAILABLE and _says_stream_held(exc):
            raise TakeoverRefused(node_id, exc.details() or "") from None
        if exc.code() == grpc.StatusCode.UNAVAILABLE and _says(exc, DRAINED_KEY):
            raise NodeFailure(node_id, FailureCause.DRAINED, exc.details() or "", received_any) from None
        if exc.code() in _NODE_FAILURE_CODES:
            cause = FailureCause.STREAM_BROKEN if received_any else FailureCause.CONNECT_FAILED
            raise NodeFailure(node_id, cause, exc.details() or exc.code().name, received_any,
                              node_is_well=_router_went_unanswered(exc)) from None
        raise from_rpc_error(exc) from None
    finally:
        timer.cancel()
        stop_watching()
        activity.close(node_id)
        call.cancel()
        # The tracing interceptor ends the call's client span only when the call's responses end: read them out
        # (at once: the call is done or cancelled). Left suspended, the span waited for the garbage collector, and
        # at exit was never exported.
        await _read_out(responses)


def _says_stream_held(error: grpc.aio.AioRpcError) -> bool:
    """The node refused on purpose: it runs another stream of the id (its status carries STREAM_HELD_KEY)."""
    return _says(error, STREAM_HELD_KEY)


def _says(error: grpc.aio.AioRpcError, key: str) -> bool:
    """Whether the status carries the trailing metadata key."""
    return any(name == key for name, _ in (error.trailing_metadata() or ()))


async def _read_out(responses: AsyncIterator[node_agent_pb2.NodeGenerateChunk]) -> None:
    """What is left of a done or cancelled call's responses, its end or its cancellation included; a cancellation
    of the task that reads (not the call's own) still ends it."""
    task = asyncio.current_task()
    cancelling = task.cancelling() if task is not None else 0
    try:
        async for _ in responses:
            pass
    except asyncio.CancelledError:
        if task is not None and task.cancelling() > cancelling:
            raise
    except grpc.aio.AioRpcError:
        pass
