"""One node's Generate stream, watched: a broken, stalled or deregistered node becomes NodeFailure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from baton.v1 import node_agent_pb2, node_agent_pb2_grpc
from services.common.errors import from_rpc_error
from services.router.generation import FailureCause, NodeFailure

# A node stream failing with these codes is the node's failure, not the request's.
_NODE_FAILURE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                       grpc.StatusCode.INTERNAL)


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


def stall_deadline_s(floor_s: float, started: node_agent_pb2.StreamStarted | None) -> float:
    """How long a node may send nothing before it counts as stalled.

    Derived from the pace the node announced: three heartbeat intervals or ten decode steps,
    whichever is longer, and never below floor_s (scheduling noise on a loaded host).
    """
    if started is None:
        return floor_s
    return max(floor_s, 3 * started.heartbeat_interval_ms / 1000, 10 * started.expected_step_ms / 1000)


async def watched_stream(
    channel: grpc.aio.Channel,
    node_id: str,
    request: node_agent_pb2.NodeGenerateRequest,
    liveness: NodeLiveness,
    stall_floor_s: float,
    timeout_s: float | None,
) -> AsyncIterator[node_agent_pb2.NodeGenerateChunk]:
    """The node's chunks that carry tokens or a finish; NodeFailure when the node fails us."""
    loop = asyncio.get_running_loop()
    call = node_agent_pb2_grpc.NodeAgentStub(channel).Generate(request, timeout=timeout_s)
    failure: FailureCause | None = None
    stall_s = stall_floor_s
    last_heard = loop.time()
    received_any = False

    def fail(cause: FailureCause) -> None:
        nonlocal failure
        if failure is None:
            failure = cause
            call.cancel()

    def check_stall() -> None:
        nonlocal timer
        idle = loop.time() - last_heard
        if idle >= stall_s:
            fail(FailureCause.STALLED)
        else:
            timer = loop.call_later(stall_s - idle, check_stall)

    timer = loop.call_later(stall_s, check_stall)
    stop_watching = liveness.on_gone(node_id, lambda: fail(FailureCause.LEASE_EXPIRED))
    try:
        async for chunk in call:
            last_heard = loop.time()
            received_any = True
            if chunk.HasField("started"):
                stall_s = stall_deadline_s(stall_floor_s, chunk.started)
            if chunk.token_ids or chunk.finish_reason:
                yield chunk
                if chunk.finish_reason:
                    return
        raise NodeFailure(node_id, FailureCause.STREAM_BROKEN, "stream ended without a finish")
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if failure is None or (current is not None and current.cancelling()):
            raise  # cancelled from outside (the client went away): not a node failure
        raise NodeFailure(node_id, failure, f"after {stall_s:.2f}s silent" if failure is FailureCause.STALLED
                          else "") from None
    except grpc.aio.AioRpcError as exc:
        if failure is not None:
            raise NodeFailure(node_id, failure) from None
        if exc.code() in _NODE_FAILURE_CODES:
            cause = FailureCause.STREAM_BROKEN if received_any else FailureCause.CONNECT_FAILED
            raise NodeFailure(node_id, cause, exc.details() or exc.code().name) from None
        raise from_rpc_error(exc) from None
    finally:
        timer.cancel()
        stop_watching()
        call.cancel()
