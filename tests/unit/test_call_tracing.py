"""The client spans of calls that answer once: the trace goes on at the server, the span ends with the call's status,
and a cancel reaches the call (services/common/call_tracing.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import call_tracing
from services.common.telemetry import Telemetry


class _Server:
    """Two methods of a service "t.T": Once (unary-unary) and Upload (stream-unary). Each answers b"ok", fails
    with NOT_FOUND when asked b"missing", or holds the call until its caller cancels it."""

    def __init__(self) -> None:
        self.traceparents: list[str] = []
        self.holding = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def _answer(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.traceparents.append(dict(context.invocation_metadata() or ()).get("traceparent", ""))
        if request == b"missing":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
        if request == b"hold":
            self.holding.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return b"ok"

    async def once(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._answer(request, context)

    async def upload(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        return await self._answer(b"".join([r async for r in requests]), context)


@pytest.fixture
async def traced_channel() -> AsyncIterator[tuple[grpc.aio.Channel, _Server, InMemorySpanExporter, Telemetry]]:
    server = _Server()
    handlers = grpc.method_handlers_generic_handler("t.T", {
        "Once": grpc.unary_unary_rpc_method_handler(server.once),
        "Upload": grpc.stream_unary_rpc_method_handler(server.upload),
    })
    grpc_server = grpc.aio.server()
    grpc_server.add_generic_rpc_handlers((handlers,))
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    spans = InMemorySpanExporter()
    telemetry = Telemetry("client/test", "none")
    telemetry.tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    try:
        async with telemetry.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel, server, spans, telemetry
    finally:
        await grpc_server.stop(None)


async def _ended(spans: InMemorySpanExporter) -> list:
    """The finished spans, once those whose calls have ended have been ended (in a task each call's end starts)."""
    await asyncio.wait_for(asyncio.gather(*call_tracing._ending), 5)
    return list(spans.get_finished_spans())


async def test_a_call_that_answers_once_is_a_client_span_whose_trace_the_server_continues(traced_channel) -> None:
    channel, server, spans, telemetry = traced_channel
    once = channel.unary_unary("/t.T/Once")
    with telemetry.tracer_provider.get_tracer("test").start_as_current_span("request") as request:
        assert await once(b"hello") == b"ok"
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await once(b"missing")
    assert failed.value.code() == grpc.StatusCode.NOT_FOUND
    ok, missing = [s for s in await _ended(spans) if s.name == "/t.T/Once"]
    for span in (ok, missing):
        assert span.kind == trace.SpanKind.CLIENT and span.parent is not None
        assert span.parent.span_id == request.get_span_context().span_id
        assert (span.attributes["rpc.system"], span.attributes["rpc.service"], span.attributes["rpc.method"]) == (
            "grpc", "t.T", "Once")
    # The server was told each call's own span: its trace goes on there.
    assert [t.split("-")[1:3] for t in server.traceparents] == [
        [f"{s.context.trace_id:032x}", f"{s.context.span_id:016x}"] for s in (ok, missing)]
    assert ok.attributes["rpc.grpc.status_code"] == 0 and ok.status.is_unset
    assert missing.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert missing.status.status_code == trace.StatusCode.ERROR and missing.status.description == "no such thing"


@pytest.mark.parametrize("method", ["Once", "Upload"])
async def test_a_cancel_of_a_traced_call_reaches_the_call(traced_channel, method: str) -> None:
    """OpenTelemetry's interceptor awaited the call's status itself, and a cancel stopped only the interceptor: the
    call ran on at the server (a leader kept a request queued for a client gone, helper-157)."""
    channel, server, spans, _ = traced_channel
    if method == "Once":
        call = channel.unary_unary("/t.T/Once")(b"hold")
    else:
        call = channel.stream_unary("/t.T/Upload")(iter([b"ho", b"ld"]))
    await asyncio.wait_for(server.holding.wait(), 5)
    call.cancel()
    await asyncio.wait_for(server.cancelled.wait(), 5)
    (span,) = await _ended(spans)
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert span.status.status_code == trace.StatusCode.ERROR
