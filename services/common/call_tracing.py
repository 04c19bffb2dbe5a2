"""Client spans for the gRPC calls that answer once (unary-unary, stream-unary), which their caller can still cancel.

OpenTelemetry's aio client interceptor for these calls awaits the call's status inside the interceptor, and grpc.aio
takes a cancel() of an intercepted call whose interceptor has not returned for a cancel of the interceptor alone: the
call itself ran on. A router whose client went away left its Place in the leader's admission queue, to be placed for
no one, and its tenant's slot held until the slot's lease ran out, 17 s later (helper-157). This interceptor returns the
call as soon as it is made, so that cancel() reaches it, and ends the span when the call ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.propagate import inject
from opentelemetry.trace import SpanKind, Status, StatusCode

# Spans waiting for their call's status (the event loop keeps only weak references to tasks).
_ending: set[asyncio.Future[None]] = set()


class _Tracing:
    """A CLIENT span per call, named and attributed as OpenTelemetry's own (rpc.system, rpc.service, rpc.method,
    rpc.grpc.status_code), carrying the trace context to the server in the call's metadata."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer(__name__, tracer_provider=tracer_provider)

    async def _traced(self, continuation: Callable[..., Awaitable[Any]], details: grpc.aio.ClientCallDetails,
                      request: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        service, _, name = method.lstrip("/").partition("/")
        span = self._tracer.start_span(method, kind=SpanKind.CLIENT,
                                       attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
        try:
            with trace.use_span(span, end_on_exit=False):
                carrier: dict[str, str] = {}
                inject(carrier)
                metadata = grpc.aio.Metadata(*tuple(details.metadata or ()), *carrier.items())
                call = await continuation(grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                                                     details.credentials, details.wait_for_ready),
                                          request)
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            span.end()
            raise
        try:
            call.add_done_callback(lambda done: _end_when_told(span, done))
        except NotImplementedError:  # not a call (an interceptor after this one answered itself): it has ended
            span.end()
        return call


class UnaryUnaryTracing(_Tracing, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable[..., Awaitable[Any]],
                                    client_call_details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await self._traced(continuation, client_call_details, request)


class StreamUnaryTracing(_Tracing, grpc.aio.StreamUnaryClientInterceptor):
    """(A channel files an interceptor under the first kind of call it intercepts: one object cannot serve both.)"""

    async def intercept_stream_unary(self, continuation: Callable[..., Awaitable[Any]],
                                     client_call_details: grpc.aio.ClientCallDetails, request_iterator: Any) -> Any:
        return await self._traced(continuation, client_call_details, request_iterator)


def _end_when_told(span: trace.Span, call: grpc.aio.Call) -> None:
    """Ends span with the status of call, which has ended (its status is read at once, but only by awaiting)."""
    ending = asyncio.ensure_future(_end(span, call))
    _ending.add(ending)
    ending.add_done_callback(_ending.discard)


async def _end(span: trace.Span, call: grpc.aio.Call) -> None:
    try:
        code = await call.code()
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, await call.details() or code.name))
    finally:
        span.end()
